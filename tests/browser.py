"""A real headless Chromium for tests that must see what a user sees (install: scripts/install-debian.sh)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


def chromium_binary() -> str:
    """Path of the chromium on PATH; a clear error naming the installer when there is none."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    raise RuntimeError("no chromium on PATH: run scripts/install-debian.sh (installs Debian's chromium package)")


def screenshot(html_path: Path | str, png_path: Path | str, width: int, height: int, timeout_s: float = 60) -> None:
    """Render a local HTML file with headless Chromium and save a PNG of the first width x height pixels."""
    html_path, png_path = Path(html_path).resolve(), Path(png_path).resolve()
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            chromium_binary(), "--headless=new",
            # Tests run as root in containers, where Chromium's sandbox cannot start.
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
            # No network: every host name fails to resolve, so a stray external resource cannot load.
            "--host-resolver-rules=MAP * ~NOTFOUND",
            # Quiet and quick: no first-run work, updates, crash reports or component downloads.
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--disable-breakpad",
            "--mute-audio", "--force-device-scale-factor=1",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={png_path}",
            html_path.as_uri(),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0 or not png_path.is_file():
        raise RuntimeError(f"chromium screenshot failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
