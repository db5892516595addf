"""Image rewards from the DDPO paper: JPEG compressibility and incompressibility.

The reward of an image is the size of its JPEG encoding (quality 95) in kilobytes: negated for
compressibility (smaller files score higher), as is for incompressibility. Both need no model and run
offline. Reward functions take ``(images, prompts, prompt_metadata)`` with images (B, 3, H, W) in [0, 1]
(or a list of PIL images) and return a float tensor (B,), the signature ``DDPOTrainer`` expects.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

JPEG_QUALITY = 95


def to_pil_images(images: torch.Tensor | Sequence[Image.Image]) -> list[Image.Image]:
    """(B, 3, H, W) floats in [0, 1] (or PIL images, passed through) -> list of RGB PIL images."""
    if not isinstance(images, torch.Tensor):
        return [image.convert("RGB") for image in images]
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # (B, 3, H, W)
    array = pixels.permute(0, 2, 3, 1).cpu().numpy()  # (B, H, W, 3)
    return [Image.fromarray(np.ascontiguousarray(image)) for image in array]


def jpeg_size_kb(image: Image.Image, quality: int = JPEG_QUALITY) -> float:
    """Size in kilobytes (1000 bytes) of ``image`` saved as a JPEG of ``quality``."""
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000.0


def jpeg_compressibility(
    images: torch.Tensor | Sequence[Image.Image], prompts: Sequence[str] | None = None,
    prompt_metadata: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Reward = minus the JPEG size in KB of each image: (B,) float32 (higher is more compressible)."""
    return -jpeg_incompressibility(images, prompts, prompt_metadata)


def jpeg_incompressibility(
    images: torch.Tensor | Sequence[Image.Image], prompts: Sequence[str] | None = None,
    prompt_metadata: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Reward = the JPEG size in KB of each image: (B,) float32 (higher is less compressible)."""
    return torch.tensor([jpeg_size_kb(image) for image in to_pil_images(images)], dtype=torch.float32)


def image_grid(images: torch.Tensor | Sequence[Image.Image], columns: int = 4) -> Image.Image:
    """Tile images (same size) into one RGB image, ``columns`` per row (for logging samples)."""
    pil = to_pil_images(images)
    if not pil:
        raise ValueError("image_grid needs at least one image")
    width, height = pil[0].size
    rows = -(-len(pil) // columns)
    grid = Image.new("RGB", (width * min(columns, len(pil)), height * rows))
    for index, image in enumerate(pil):
        grid.paste(image, ((index % columns) * width, (index // columns) * height))
    return grid
