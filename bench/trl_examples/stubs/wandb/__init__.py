"""An offline stand-in for Weights & Biases, put beside every run (TRL's and rlhf_core's alike) by the harness.

TRL's notebooks call ``wandb.init()`` and log through ``log_with="wandb"``; no machine here reaches wandb.ai and the
venvs do not install it. This accepts those calls and keeps nothing, so a notebook is judged on its training code.
"""

__version__ = "0.0.0"


class _Config(dict):
    def update(self, values=None, allow_val_change=False, **kwargs):  # noqa: D401 - wandb's signature
        super().update(values or {}, **kwargs)


class Run:
    def __init__(self, **kwargs):
        self.config = _Config(kwargs.get("config") or {})
        self.name, self.id, self.url = kwargs.get("name") or "offline", "offline", None
        self.summary = {}

    def log(self, data, step=None, commit=None, **kwargs):
        pass

    def finish(self, *args, **kwargs):
        pass

    def watch(self, *args, **kwargs):
        pass


run = None
config = _Config()


def init(*args, **kwargs):
    global run, config
    run = Run(**kwargs)
    config = run.config
    return run


def log(data, step=None, commit=None, **kwargs):
    pass


def finish(*args, **kwargs):
    pass


def watch(*args, **kwargs):
    pass


class Table:
    def __init__(self, columns=None, data=None, dataframe=None, **kwargs):
        self.columns, self.data = columns, data


class Image:
    def __init__(self, data, caption=None, **kwargs):
        self.data, self.caption = data, caption


class Histogram:
    def __init__(self, sequence=None, **kwargs):
        self.sequence = sequence
