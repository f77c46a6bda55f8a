"""The app's routes, one :class:`fastapi.APIRouter` per resource: ``system`` (health,
readiness, metrics, models, the playground page), ``images`` and ``videos``."""
