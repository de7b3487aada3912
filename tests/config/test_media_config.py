"""``[frontend.media]`` in a topology file: parsed through the loader, its mistakes named by file and
key (the way an operator meets them with ``--check``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.loader import TopologyError, load_topology
from config.topology import MediaConfig

MODEL = '[model]\nname = "m"\npath = "tiny"\n'


def write(tmp_path: Path, media: str) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(MODEL + "\n[frontend.media]\n" + media)
    return path


def test_defaults_fetch_nothing(tmp_path: Path) -> None:
    m = load_topology(write(tmp_path, "")).frontend.media
    assert m == MediaConfig()
    assert (m.allow_urls, m.max_images, m.max_image_bytes, m.max_total_bytes) == ([], 8, 4 << 20, 6 << 20)
    assert m.formats == ["PNG", "JPEG", "WEBP", "GIF", "BMP"]


def test_the_table_parses(tmp_path: Path) -> None:
    path = write(tmp_path, 'max_images = 2\nmax_image_bytes = 1048576\nmax_pixels = 1000000\n'
                           'formats = ["png", "JPEG"]\nallow_urls = ["images.example.com", '
                           '"https://cdn.example.com/public/"]\nfetch_timeout = 2.5\nmax_concurrent_fetches = 1\n')
    m = load_topology(path, overrides=["frontend.media.max_total_bytes=2097152"]).frontend.media
    assert m == MediaConfig(max_images=2, max_image_bytes=1 << 20, max_total_bytes=2 << 20, max_pixels=1_000_000,
                            formats=["png", "JPEG"], fetch_timeout=2.5, max_concurrent_fetches=1,
                            allow_urls=["images.example.com", "https://cdn.example.com/public/"])


@pytest.mark.parametrize(("media", "problem"), [
    ("max_image = 3\n", "frontend.media.max_image: unknown key (allowed: max_images, max_image_bytes, "),
    ("max_images = 0\n", "frontend.media.max_images: expected a number > 0, got 0"),
    ("fetch_timeout = -1.0\n", "frontend.media.fetch_timeout: expected a number > 0, got -1.0"),
    ("max_concurrent_fetches = 0\n", "frontend.media.max_concurrent_fetches: expected a number > 0, got 0"),
    ('allow_urls = "images.example.com"\n', "frontend.media.allow_urls: expected array, got str ('images.example.com')"),
    ("formats = []\n", "frontend.media.formats: name at least one image format"),
    ('formats = ["PNG", "PNGG"]\n', "frontend.media.formats.1: Pillow cannot open 'PNGG' (it opens: "),
])
def test_mistakes_name_file_and_key(tmp_path: Path, media: str, problem: str) -> None:
    path = write(tmp_path, media)
    with pytest.raises(TopologyError) as ei:
        load_topology(path)
    assert str(ei.value).startswith(f"{path}: {problem}")
