"""What the benchmarks ran on: CPU, memory, disk, software versions."""

from __future__ import annotations

import os
import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "torch",
    "tierstore",
    "fsspec",
    "s3fs",
    "botocore",
    "aiobotocore",
    "moto",
    "crc32c",
    "s3torchconnector",
    "matplotlib",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mount_of(path: Path) -> dict[str, str]:
    """Device and filesystem type of the mount holding ``path`` (longest prefix wins)."""
    best = {"device": "unknown", "fstype": "unknown", "mount": "/"}
    real = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best["mount"]):
                best = {"device": device, "fstype": fstype, "mount": mount}
    except OSError:
        pass
    return best


def _rotational(device: str) -> str:
    name = os.path.basename(device)
    flag = Path(f"/sys/block/{name}/queue/rotational")
    try:
        rotational = flag.read_text().strip() == "1"
    except OSError:
        return "unknown kind"
    if name.startswith("vd"):
        return "virtio disk"  # reports rotational=1 whatever lies behind it
    return "rotational" if rotational else "non-rotational"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe(scratch: Path) -> dict[str, Any]:
    mount = _mount_of(scratch)
    usage = shutil.disk_usage(scratch)
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _mem_total(),
        "disk": {
            **mount,
            "kind": _rotational(mount["device"]),
            "size_bytes": usage.total,
            "free_bytes": usage.free,
        },
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": {name: _version(name) for name in PACKAGES},
        "fio": shutil.which("fio") is not None,
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
    }
