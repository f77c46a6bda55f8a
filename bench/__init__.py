"""omni's benchmarks, each run as a script: ``python3 bench/<name>.py``.

A script run that way has bench/ itself on ``sys.path`` and imports its siblings by their bare
names; imported as ``bench.<name>`` (the tests) it imports them from the package.
"""
