"""The one place for the GPUs' peak numbers: the denominators of every MFU and bandwidth floor in the GPU bench.

Dense figures from NVIDIA's H100 and H200 datasheets (the datasheets print tensor-core figures with 2:4 sparsity;
the dense ones are half). ``bf16``/``tf32``: tensor-core TFLOP/s; ``fp32``: non-tensor TFLOP/s (torch's default
for fp32 matmuls: TF32 is off); ``hbm``: memory bandwidth in TB/s (1e12 bytes/s); ``memory``: GB.
Each run also measures the card's best bf16 matmul and device-to-device copy (``probe.py``): what is reachable.
"""

from __future__ import annotations

CARDS = {
    # torch.cuda.get_device_name() says e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
    # "NVIDIA H200" (SXM), "NVIDIA H200 NVL"
    "H100 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9, "hbm": 3.35, "memory": 80},
    "H100 PCIe": {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2, "hbm": 2.0, "memory": 80},
    "H100 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0, "hbm": 3.9, "memory": 94},
    "H200 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9, "hbm": 4.8, "memory": 141},
    "H200 NVL": {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0, "hbm": 4.8, "memory": 141},
}


def card(device_name: str | None) -> str | None:
    """The ``CARDS`` key of a ``torch.cuda.get_device_name()``, or None for another device (a CPU, another GPU)."""
    name = (device_name or "").upper()
    for model in ("H100", "H200"):
        if model in name:
            form = "NVL" if "NVL" in name else "PCIe" if "PCIE" in name else "SXM"
            return f"{model} {form}"
    return None


def peak(device_name: str | None, what: str) -> float | None:
    """``CARDS[card][what]`` for this device (TFLOP/s, TB/s or GB), or None when the card is not in the table."""
    key = card(device_name)
    return CARDS[key][what] if key else None
