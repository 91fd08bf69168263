"""A finished job's pictures: its thumbnail (the API's `thumbnail` variant), its spritesheet (`spritesheet`) and a
preview frame as a data URL for SSE subscribers. Each is made from the MP4 with PyAV and Pillow; a picture that
cannot be made is None, never a failed job.
"""

from __future__ import annotations

import base64
import io
import logging
import secrets
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

THUMBNAIL_SUFFIX = ".jpg"
SPRITESHEET_SUFFIX = ".sprites.jpg"
SPRITESHEET_GRID = (5, 5)  # columns, rows: 25 frames evenly spread over the clip
SPRITE_WIDTH = 256


def write_thumbnail(video_path: Path) -> Path | None:
    """A JPEG poster (the middle frame) beside the MP4; None when it cannot be made."""
    import av

    target = video_path.with_suffix(THUMBNAIL_SUFFIX)
    try:
        with av.open(str(video_path)) as container:
            stream = container.streams.video[0]
            middle, poster = (stream.frames or 0) // 2, None
            for index, frame in enumerate(container.decode(stream)):  # one decoded frame held at a time
                poster = frame
                if index >= middle:
                    break
        if poster is None:
            return None
        image = poster.to_image()
        partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial")
        image.save(partial, format="JPEG", quality=85)
        partial.replace(target)
        return target
    except Exception:
        logger.exception("no thumbnail for %s", video_path)
        return None


def write_spritesheet(video_path: Path) -> Path | None:
    """A JPEG grid of frames evenly spread over the clip, left to right then top to bottom (OpenAI's "spritesheet"
    variant), beside the MP4; None when the clip has no frames."""
    import av
    from PIL import Image

    columns, rows = SPRITESHEET_GRID
    target = video_path.with_suffix(SPRITESHEET_SUFFIX)
    with av.open(str(video_path)) as container:
        stream = container.streams.video[0]
        count = stream.frames or 0
        wanted = {round(index * max(0, count - 1) / (columns * rows - 1)) for index in range(columns * rows)}
        sprites = [
            frame.to_image()
            for index, frame in enumerate(container.decode(stream))
            if index in wanted or not count
        ]
    if not sprites:
        return None
    sprites = sprites[: columns * rows]
    width = min(SPRITE_WIDTH, sprites[0].width)
    height = max(1, round(sprites[0].height * width / sprites[0].width))
    sheet = Image.new("RGB", (columns * width, rows * height))
    for index, sprite in enumerate(sprites):
        sheet.paste(sprite.resize((width, height)), ((index % columns) * width, (index // columns) * height))
    partial = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial")
    try:
        sheet.save(partial, format="JPEG", quality=85)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def preview_data_url(rgb: Any) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
