"""``cluster.container``: the image every rank of a Slurm job runs in, checked at load."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field

from rollhpc.config.loading import ConfigError


@dataclass(kw_only=True)
class ContainerConfig:
    """The image every MPI rank of a Slurm job runs in (``cluster.container``; slurm/README.md, "Containers").

    rollhpc.launch.slurm wraps each rank's command: ``apptainer exec [--nv] --bind ... IMAGE python3 -m
    rollhpc.rank`` or pyxis's ``srun --container-image=IMAGE --container-mounts=...``. The batch script and its
    requeue helpers stay on the host: they run scontrol, sbatch and squeue, which an image does not have. Every
    value is checked here, at load, because a wrong one would otherwise show only as a job that fails on its nodes.
    """

    kind: typing.Literal["none", "apptainer", "pyxis"] = "none"  # none: the ranks run on the host
    # apptainer: an absolute path to a .sif (or a sandbox directory) that every node sees; pyxis: an enroot
    # image, "[USER@][REGISTRY#]IMAGE[:TAG]" (quote a '#' in an override) or an absolute path to a .sqsh
    image: str = ""
    # bind mounts "src[:dst[:opts]]", absolute paths (dst defaults to src); opts: apptainer's ro|rw, pyxis's
    # mount flags joined with "+" (ro+rprivate). The run directory is added at its own path unless a writable
    # mount shows it there already (the ranks and the batch-side helpers must name it alike).
    mounts: list[str] = field(default_factory=list)
    # more options, one per item ("--flag" or "--flag=value"): apptainer exec's (--writable-tmpfs), or pyxis's
    # srun options (--container-workdir=/work, --no-container-mount-home, --container-writable)
    extra: list[str] = field(default_factory=list)
    python: str = "python3"  # the image's interpreter for `-m rollhpc.rank`: a name on the image's PATH or a path
    # the host interpreter for the batch-side `-m rollhpc.launch.requeue` helpers (stdlib and pyyaml suffice);
    # "": the one that ran `rollhpc submit`, as without a container: it must then be visible on the batch node
    batch_python: str = ""

    KINDS = ("none", "apptainer", "pyxis")
    # apptainer exec options that start the container with a cleared environment: srun's PMI_* variables (the
    # MPI wiring) and SLURM_*/CUDA_VISIBLE_DEVICES would not reach the ranks
    CLEARS_ENV = ("-e", "--cleanenv", "-C", "--containall", "--compat")
    PYXIS_FLAGS = re.compile(r"[A-Za-z0-9_=.-]+(\+[A-Za-z0-9_=.-]+)*")

    def __post_init__(self) -> None:
        w = "cluster.container"
        if self.kind not in self.KINDS:
            raise ConfigError(f"{w}.kind: {self.kind!r} is not one of {list(self.KINDS)}")
        if self.kind == "none":
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name != "kind"
                and getattr(self, f.name)
                != (f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
            ]
            if given:
                raise ConfigError(
                    f"{w}.{given[0]}: set, but {w}.kind is 'none' (the ranks run on the host): set "
                    f"{w}.kind=apptainer or {w}.kind=pyxis, or drop it"
                )
            return
        self._check_image(w)
        for i, mount in enumerate(self.mounts):
            self._check_mount(mount, f"{w}.mounts[{i}]")
        for i, opt in enumerate(self.extra):
            self._check_option(opt, f"{w}.extra[{i}]")
        for name in ("python", "batch_python"):
            value = getattr(self, name)
            if value and (
                value != value.strip()
                or len(value.split()) != 1
                or ("/" in value and value[0] != "/")
            ):
                raise ConfigError(
                    f"{w}.{name}: {value!r} is not one interpreter: give a name found on the PATH or "
                    "an absolute path (a relative one depends on the job's working directory)"
                )
        if not self.python:
            raise ConfigError(
                f"{w}.python: empty: name the image's interpreter (python3, /opt/venv/bin/python)"
            )

    def _check_image(self, w: str) -> None:
        image = self.image
        if not image.strip():
            what = "a .sif path" if self.kind == "apptainer" else "an enroot image or a .sqsh path"
            raise ConfigError(
                f"{w}.image: empty: kind {self.kind} needs the image every rank runs in ({what})"
            )
        if image != image.strip() or len(image.split()) != 1:
            raise ConfigError(f"{w}.image: {image!r} contains whitespace")
        if self.kind == "apptainer":
            if "://" in image:  # every rank would pull and convert it at once, on every start
                raise ConfigError(
                    f"{w}.image: {image!r}: every rank would pull and convert it as it starts; "
                    f"build it once (apptainer build /shared/images/NAME.sif {image}) and name the .sif"
                )
            if not image.startswith("/"):
                raise ConfigError(
                    f"{w}.image: {image!r} is relative: give an absolute path on a filesystem every "
                    "node mounts (a resumed run may start in another working directory)"
                )
        elif image.endswith(".sif"):
            raise ConfigError(
                f"{w}.image: {image!r} is an Apptainer image: enroot (pyxis) imports a registry image "
                f"or a squashfs file (.sqsh); or set {w}.kind=apptainer"
            )
        elif image.endswith((".sqsh", ".squashfs")) and not image.startswith("/"):
            raise ConfigError(
                f"{w}.image: {image!r}: pyxis reads a name that does not start with / (or ./) as a "
                "registry image: give the squashfs file's absolute path"
            )

    def _check_mount(self, mount: str, where: str) -> None:
        form = "'src[:dst[:opts]]' with absolute paths, one mount per item"
        parts = mount.split(":")
        if "," in mount or len(parts) > 3 or "" in parts or any(p != p.strip() for p in parts):
            raise ConfigError(f"{where}: {mount!r} is not {form}")
        if not all(p.startswith("/") for p in parts[:2]):
            raise ConfigError(
                f"{where}: {mount!r}: source and destination must be absolute paths ({form})"
            )
        if len(parts) == 3:
            opts = parts[2]
            if self.kind == "apptainer" and opts not in ("ro", "rw"):
                raise ConfigError(
                    f"{where}: {mount!r}: apptainer's bind options are ro or rw, got {opts!r}"
                )
            if self.kind == "pyxis" and not self.PYXIS_FLAGS.fullmatch(opts):
                raise ConfigError(
                    f"{where}: {mount!r}: pyxis's mount flags are joined with '+' (ro+rprivate), "
                    f"got {opts!r}"
                )

    def _check_option(self, opt: str, where: str) -> None:
        if not opt.startswith("-") or len(opt.split()) != 1 or opt != opt.strip():
            raise ConfigError(
                f"{where}: {opt!r}: one option per item, written --flag or --flag=value"
            )
        name = opt.partition("=")[0]
        if self.kind == "apptainer" and name in self.CLEARS_ENV:
            raise ConfigError(
                f"{where}: {opt!r} clears the environment inside the container: srun's PMI_* "
                "variables would not reach MPI (each rank would form a world of its own), nor "
                "SLURM_* and CUDA_VISIBLE_DEVICES the rank's GPU binding"
            )
        if self.kind == "pyxis":
            if not name.startswith(("--container-", "--no-container-")):
                raise ConfigError(
                    f"{where}: {opt!r}: pyxis's options are srun's --container-* and "
                    "--no-container-* (an apptainer flag?)"
                )
            if name in ("--container-image", "--container-mounts"):
                raise ConfigError(
                    f"{where}: {opt!r}: set it with cluster.container.{name.rsplit('-', 1)[1]}"
                )
