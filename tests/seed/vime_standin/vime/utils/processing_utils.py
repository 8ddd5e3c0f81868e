"""Stand-in for ``vime.utils.processing_utils.encode_image_for_rollout_engine`` (seed contract section 4)."""

from __future__ import annotations

import base64
import io
from typing import Any


def encode_image_for_rollout_engine(image: Any) -> str:
    """Encode a PIL-like image as a ``data:image/png;base64,...`` URL, converting it to RGB first if needed."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
