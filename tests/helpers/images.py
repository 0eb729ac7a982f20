"""What the tests read off a PNG a run wrote (metrics.png, the timeline's picture)."""
from __future__ import annotations


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, after Pillow (matplotlib's own dependency) decoded all of it."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as img:
        assert img.format == "PNG"
        img.load()  # decodes every pixel: a truncated or corrupt file raises here
        return img.size


def distinct_colours(path) -> int:
    from PIL import Image

    with Image.open(path) as img:
        return len(img.convert("RGB").getcolors(maxcolors=1 << 20))
