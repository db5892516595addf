"""``DatasetMixtureConfig`` and ``get_dataset``: TRL 1.x scripts' ``datasets:`` list, loaded and concatenated.

Each entry is ``datasets.load_dataset``'s arguments; entries are concatenated in order (keeping ``columns`` when
given); ``fraction`` (all entries or none) keeps the first ``round(share * N)`` rows of each, where the shares are
the fractions normalised to one and ``N`` is the largest mixture no entry would have to repeat rows for;
``test_split_size`` splits the result into ``train`` and ``test``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DatasetConfig:
    """One dataset of a mixture: ``datasets.load_dataset``'s arguments plus the columns and share to keep."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DatasetMixtureConfig:
    """The datasets of a mixture, whether to stream them, and an optional test share."""

    datasets: list[DatasetConfig] = field(default_factory=list, metadata={"help": "Datasets of the mixture."})
    streaming: bool = field(default=False, metadata={"help": "Stream the datasets."})
    test_split_size: float | None = field(default=None, metadata={"help": "Share (or count) held out as `test`."})

    def __post_init__(self) -> None:
        self.datasets = [DatasetConfig(**d) if isinstance(d, dict) else d for d in self.datasets]
        fractions = [d.fraction for d in self.datasets]
        if any(f is not None for f in fractions) and any(f is None for f in fractions):
            raise ValueError("DatasetMixtureConfig.datasets: set `fraction` on every dataset or on none")
        for i, f in enumerate(fractions):
            if f is not None and not f > 0:
                raise ValueError(f"DatasetMixtureConfig.datasets[{i}].fraction={f}: must be > 0")
        if self.streaming and fractions and fractions[0] is not None:
            raise ValueError("DatasetMixtureConfig: `fraction` needs row counts, which streaming datasets lack")


def _load(config: DatasetConfig, streaming: bool) -> Any:
    import datasets  # heavy; only when a script loads its data

    ds = datasets.load_dataset(config.path, name=config.name, data_dir=config.data_dir,
                               data_files=config.data_files, split=config.split, streaming=streaming)
    return ds.select_columns(config.columns) if config.columns else ds


def mixture_sizes(lengths: list[int], fractions: list[float]) -> list[int]:
    """Rows kept of each dataset: shares ``fractions / sum``, total the largest that needs no repeated rows."""
    shares = [f / sum(fractions) for f in fractions]
    total = min(n / s for n, s in zip(lengths, shares))
    return [min(n, round(s * total)) for n, s in zip(lengths, shares)]


def get_dataset(mixture_config: DatasetMixtureConfig) -> Any:
    """A ``DatasetDict`` of the mixture: ``train`` (and ``test`` with ``test_split_size``)."""
    import datasets  # heavy; only when a script loads its data

    if not mixture_config.datasets:
        raise ValueError("DatasetMixtureConfig.datasets is empty: name at least one dataset")
    parts = [_load(c, mixture_config.streaming) for c in mixture_config.datasets]
    if mixture_config.datasets[0].fraction is not None:
        sizes = mixture_sizes([len(p) for p in parts], [c.fraction for c in mixture_config.datasets])
        parts = [p.select(range(n)) for p, n in zip(parts, sizes)]
    mixed = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if mixture_config.test_split_size is not None:
        return mixed.train_test_split(test_size=mixture_config.test_split_size)
    return datasets.DatasetDict({"train": mixed}) if not mixture_config.streaming else \
        datasets.IterableDatasetDict({"train": mixed})
