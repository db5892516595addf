"""What MLflow loads as a registered policy version (``log_policy_model`` points ``mlflow.pyfunc.log_model`` here):
MLflow's "models from code", so each version is this file, ``tasks.policy_model`` and its weights, never a pickle."""

import mlflow

from tasks.policy_model import RegisteredPolicy

mlflow.models.set_model(RegisteredPolicy())
