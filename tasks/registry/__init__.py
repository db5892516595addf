"""The MLflow registry: the gate that registers a policy and moves champion, and the registered version (the
project's policy pyfunc, logged as models from code)."""
