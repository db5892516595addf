"""What MLflow loads as a registered policy version (``log_policy_model`` points ``mlflow.pyfunc.log_model`` here):
MLflow's "models from code", so each version is this file, ``tasks.registry.policy_pyfunc`` and its weights, never a pickle."""

import mlflow

from tasks.registry.policy_pyfunc import RegisteredPolicy

mlflow.models.set_model(RegisteredPolicy())
