"""What MLflow loads as the served policy (``save_server`` points ``mlflow.pyfunc.save_model`` here): MLflow's
"models from code", so the served model is this file and ``tasks.serving``, never a pickle."""

import mlflow

from tasks.serving import PolicyServer

mlflow.models.set_model(PolicyServer())
