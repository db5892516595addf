"""What MLflow loads as the served policy of the loop (``save_server`` points ``mlflow.pyfunc.save_model`` here):
MLflow's "models from code", so the served model is this file and ``tasks.serving.alias_server``, never a pickle."""

import mlflow

from tasks.serving.alias_server import PolicyServer

mlflow.models.set_model(PolicyServer())
