"""The old path of the registered policy: versions registered before tasks/ had floors name ``tasks.policy_model``
in their code file (``registered_model.py`` in each version's artifacts), so that import keeps loading them.
New versions import ``tasks.registry.policy_pyfunc``."""

from tasks.registry.policy_pyfunc import RegisteredPolicy  # noqa: F401
