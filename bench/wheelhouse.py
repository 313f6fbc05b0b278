"""Download the wheels a GPU image may lack into ``wheelhouse/``, for the offline acceptance run.

    make wheelhouse                        # where PyPI is reachable; then copy the checkout (with wheelhouse/) to the GPU box
    python -m bench.wheelhouse --dest wheelhouse --python-version 3.12

A typical CUDA image has torch, numpy and transformers (with huggingface_hub and safetensors) but
not optuna, plotly, rich, pandas, accelerate, nvidia-ml-py or pytest. This downloads those and
everything they require, for CPython 3.12 on x86_64 manylinux, with ``--only-binary=:all:`` (no
build step offline) and ``--no-deps`` (pip would otherwise resolve torch too, gigabytes). The
dependency closure is computed here instead, from each wheel's ``Requires-Dist`` evaluated for the
target interpreter; the packages named in :data:`IMAGE_PROVIDES` are left to the image.

Versions are those installed in the running environment where it has them (they were resolved
together, so they agree), else the newest that pip finds. Every distribution ends up with exactly
one wheel; a requirement that a chosen version does not satisfy is reported. pyarrow is left out:
only ``--dataset x.parquet`` needs it.

``--deepspeed`` (``make wheelhouse-deepspeed``) also builds DeepSpeed's wheel here and adds its dependencies (the
``sharding`` values; its ops are compiled with ninja on the GPU machine on first use).

``--bitsandbytes`` (``make wheelhouse-qlora``) also unpacks bitsandbytes, for ``--peft qlora`` and the
8-bit optimizers, into ``wheelhouse/bnb_site`` (put it on ``PYTHONPATH``; ``bench/gpu_peft_studies.sh``
does): its wheel carries a library per CUDA and ROCm version (43 MiB), which with the wheels above
would pass the 64 MiB a device call may carry, so only the CPU library and those of the image's
CUDA major version (``--cuda``, default 13: torch 2.11's) are kept, 8 MiB.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOTS = (
    "optuna", "plotly", "rich", "nvidia-ml-py", "pyyaml", "pandas", "accelerate", "pytest", "pytest-timeout",
    "tqdm", "colorlog", "typing-extensions", "packaging",
)
# What any torch + transformers image already has; downloading torch would be gigabytes.
IMAGE_PROVIDES = frozenset({"torch", "numpy", "transformers", "huggingface-hub", "safetensors", "tokenizers"})
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of the interpreter the wheels are for."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "implementation_version": f"{python_version}.0",
        "platform_python_implementation": "CPython",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def wheel_requirements(path: Path, environment: dict[str, str]) -> list[Requirement]:
    """The ``Requires-Dist`` of a wheel that apply to ``environment`` (no extras)."""
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    requirements = []
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate(environment):
            requirements.append(requirement)
    return requirements


def wheels_by_name(dest: Path) -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(dest.glob("*.whl")):
        found.setdefault(canonicalize_name(parse_wheel_filename(path.name)[0]), []).append(path)
    return found


def pinned(name: str) -> str:
    """``name==version`` as installed here, else the bare name (pip picks the newest)."""
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        return name


def download(requirements: list[str], dest: Path, python_version: str) -> None:
    abi = "cp" + python_version.replace(".", "")
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
        "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp", "--abi", abi,
        *[arg for platform in PLATFORMS for arg in ("--platform", platform)], "-d", str(dest), *requirements,
    ]
    subprocess.run(command, check=True)


def build(dest: Path, python_version: str, deepspeed: bool = False) -> dict[str, Path]:
    """Fill ``dest`` with the closure of :data:`ROOTS` (and with ``deepspeed``, of DeepSpeed: :func:`deepspeed_wheel`),
    one wheel per distribution; returns name -> wheel.

    Raises:
        SystemExit: when a distribution has two wheels or a requirement is not met.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):  # one version of each: start from an empty folder
        stale.unlink()
    environment = target_environment(python_version)
    wanted = [canonicalize_name(n) for n in ROOTS]
    if deepspeed:
        deepspeed_wheel(dest)
        wanted.append("deepspeed")
    while True:
        have = wheels_by_name(dest)
        missing = [n for n in dict.fromkeys(wanted) if n not in have]
        if not missing:
            break
        download([pinned(n) for n in missing], dest, python_version)
        have = wheels_by_name(dest)
        for paths in have.values():
            for requirement in wheel_requirements(paths[0], environment):
                name = canonicalize_name(requirement.name)
                if name not in IMAGE_PROVIDES:
                    wanted.append(name)
    have = wheels_by_name(dest)
    duplicates = {n: [p.name for p in paths] for n, paths in have.items() if len(paths) > 1}
    if duplicates:
        raise SystemExit(f"more than one wheel for {duplicates}: delete {dest} and run again")
    versions = {n: str(parse_wheel_filename(paths[0].name)[1]) for n, paths in have.items()}
    problems = []
    for name, paths in have.items():
        for requirement in wheel_requirements(paths[0], environment):
            other = canonicalize_name(requirement.name)
            if other in versions and requirement.specifier and not requirement.specifier.contains(versions[other], prereleases=True):
                problems.append(f"{name} needs {requirement}, the wheelhouse has {other} {versions[other]}")
    if problems:
        raise SystemExit("inconsistent wheelhouse: " + "; ".join(problems))
    return {n: paths[0] for n, paths in have.items()}


def deepspeed_wheel(dest: Path) -> Path:
    """Build DeepSpeed's wheel into ``dest`` (PyPI has only its source; built without its ops, ``DS_BUILD_OPS=0``, so it is
    pure Python: its CPU Adam and communication ops are compiled on first use, with ninja, on the machine that runs them)."""
    import os

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps", "-w", str(dest),
                    pinned("deepspeed")], check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    return next(dest.glob("deepspeed-*.whl"))


BNB_SITE = "bnb_site"  # in the wheelhouse: an unpacked bitsandbytes, for PYTHONPATH


def unpack_bitsandbytes(wheel: Path, site: Path, cuda_major: int) -> list[str]:
    """Unpack the bitsandbytes ``wheel`` into ``site`` with only the native libraries for the CPU and
    CUDA ``cuda_major``.x; returns the libraries kept. bitsandbytes loads ``libbitsandbytes_cuda<XY>``
    for the CUDA torch was built with, so the others are dead weight on that image."""
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda_major}\d)\.\w+$")
    kept = []
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            name = member.rsplit("/", 1)[-1]
            if name.startswith("libbitsandbytes_") and not keep.search(name):
                continue
            archive.extract(member, site)
            if name.startswith("libbitsandbytes_"):
                kept.append(name)
    return sorted(kept)


def bitsandbytes_site(dest: Path, python_version: str, cuda_major: int) -> Path:
    """Download bitsandbytes (the installed version where there is one) and unpack it, slimmed, into ``dest/bnb_site``."""
    import shutil
    import tempfile

    site = dest / BNB_SITE
    shutil.rmtree(site, ignore_errors=True)
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "--python-version", python_version, "--platform", "manylinux_2_24_x86_64",
                        "-d", folder, pinned("bitsandbytes")], check=True)
        wheel = next(Path(folder).glob("bitsandbytes-*.whl"))
        kept = unpack_bitsandbytes(wheel, site, cuda_major)
    if not any("cuda" in name for name in kept):
        raise SystemExit(f"{wheel.name} has no library for CUDA {cuda_major}.x: pick another --cuda, or another bitsandbytes")
    return site


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default="wheelhouse", type=Path)
    parser.add_argument("--python-version", default="3.12", help="of the GPU image's interpreter (default 3.12)")
    parser.add_argument("--bitsandbytes", action="store_true", help="also unpack bitsandbytes (QLoRA, 8-bit optimizers) into DEST/bnb_site")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed (built here: PyPI has only its source) and what it needs, "
                        "for the sharding values zero1-3 and ZeRO-Offload")
    parser.add_argument("--cuda", type=int, default=13, help="with --bitsandbytes: the CUDA major version torch was built with there (default 13)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error("--python-version is MAJOR.MINOR, e.g. 3.12")
    wheels = build(args.dest, args.python_version, deepspeed=args.deepspeed)
    total = 0
    for name in sorted(wheels):
        size = wheels[name].stat().st_size
        total += size
        print(f"{size / 2**20:8.2f} MiB  {wheels[name].name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}/ (left to the image: {', '.join(sorted(IMAGE_PROVIDES))})")
    if args.bitsandbytes:
        site = bitsandbytes_site(args.dest, args.python_version, args.cuda)
        size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
        print(f"bitsandbytes unpacked into {site}/ ({size / 2**20:.1f} MiB): PYTHONPATH={site} on the GPU machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
