"""Offline checks of ``deploy/``: the Kubernetes manifests, the systemd unit,
the Dockerfile and the README.

- Core Kubernetes objects, and the pod / Job templates inside the CRDs, are
  validated against the Kubernetes OpenAPI schemas bundled with
  ``kubernetes-validate`` in strict mode (unknown fields are errors), for the
  oldest Kubernetes minor the manifests target and the newest one bundled.
- The CRD objects themselves (PyTorchJob, JobSet) are validated with
  ``jsonschema`` against the schemas in ``deploy/k8s/schemas/``.
- Negative tests prove both validators are live: a typo'd field is rejected.
- Then the properties the manifests exist for: torchrun's shape matches the
  replicas and GPUs, rendezvous reaches a headless Service, the daemon's
  flags, probes, ports, token and snapshot volume agree with each other.

Needs ``kubernetes-validate`` (which brings ``jsonschema`` and ``PyYAML``); the
whole module is skipped without it. No network is used.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

kv = pytest.importorskip("kubernetes_validate", reason="pip install 'kubernetes-validate>=1.30'")
import jsonschema  # noqa: E402  (a dependency of kubernetes-validate)
import yaml  # noqa: E402  (a dependency of kubernetes-validate)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SCHEMAS = K8S / "schemas"
UNIT = DEPLOY / "systemd" / "tensorwire-serve.service"
SERVE_ENV = DEPLOY / "systemd" / "serve.env"
DOCKERFILE = DEPLOY / "Dockerfile"

# Oldest Kubernetes minor the manifests target (native gRPC probes are GA since
# 1.27), and the newest schema set kubernetes-validate bundles.
K8S_VERSIONS = ("1.29.0", kv.latest_version())

# `tensorwire serve` flags (see the CLI), and the global --log-level.
SERVE_FLAGS = {
    "--host",
    "--port",
    "--data-port",
    "--transport",
    "--max-bytes",
    "--token-file",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--insecure",
    "--metrics-port",
    "--snapshot-dir",
}
VALUELESS_FLAGS = {"--insecure"}
ENV_NAMES = {"TENSORWIRE_" + f[2:].upper().replace("-", "_") for f in SERVE_FLAGS} | {"TENSORWIRE_LOG_LEVEL"}

EXPECTED_SERVE_FLAGS = {
    "--host": "0.0.0.0",
    "--port": "7100",
    "--data-port": "7101",
    "--metrics-port": "9100",
    "--token-file": "/etc/tensorwire/token",
    "--snapshot-dir": "/var/lib/tensorwire",
}
TRAIN_SCRIPT = "examples/pipeline_parallel.py"
RDZV_PORT = 29400

MANIFESTS = {
    "pytorchjob.yaml": {"PyTorchJob"},
    "jobset.yaml": {"Service", "JobSet"},
    "serve-statefulset.yaml": {"Service", "StatefulSet"},
    "serve-secret.example.yaml": {"Secret"},
    "serve-client.example.yaml": {"Job"},
}
CRD_SCHEMAS = {
    "PyTorchJob": "pytorchjob-kubeflow-v1.schema.json",
    "JobSet": "jobset-v1alpha2.schema.json",
}


# --------------------------------------------------------------------------- helpers


def load_docs(name: str) -> list[dict]:
    with open(K8S / name, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def all_docs() -> list[tuple[str, dict]]:
    return [(name, doc) for name in sorted(MANIFESTS) for doc in load_docs(name)]


def one(name: str, kind: str) -> dict:
    docs = [d for d in load_docs(name) if d["kind"] == kind]
    assert len(docs) == 1, f"{name}: expected one {kind}, found {len(docs)}"
    return docs[0]


def doc_id(item) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


def load_schema(kind: str) -> dict:
    with open(SCHEMAS / CRD_SCHEMAS[kind], encoding="utf-8") as f:
        return json.load(f)


def crd_embedded_objects(doc: dict) -> list[tuple[str, dict]]:
    """Core objects hidden inside a CRD, as documents kubernetes-validate knows.

    PyTorchJob replica templates are PodTemplateSpecs (wrapped in a PodTemplate);
    JobSet replicatedJobs[].template is a JobTemplateSpec (wrapped in a Job). The
    CRD's own metadata is an ObjectMeta (wrapped in a ConfigMap).
    """
    name = doc["metadata"]["name"]
    out = [("metadata", {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]})]
    if doc["kind"] == "PyTorchJob":
        for rtype, rspec in doc["spec"]["pytorchReplicaSpecs"].items():
            out.append(
                (
                    f"pytorchReplicaSpecs.{rtype}.template",
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{name}-{rtype.lower()}"},
                        "template": rspec["template"],
                    },
                )
            )
    elif doc["kind"] == "JobSet":
        for rj in doc["spec"]["replicatedJobs"]:
            meta = dict(rj["template"].get("metadata") or {})
            meta.setdefault("name", f"{name}-{rj['name']}")
            out.append(
                (
                    f"replicatedJobs[{rj['name']}].template",
                    {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": rj["template"]["spec"]},
                )
            )
    else:  # pragma: no cover - guarded by MANIFESTS
        raise AssertionError(doc["kind"])
    return out


def training_pods(doc: dict) -> tuple[int, list[tuple[str, dict, dict]]]:
    """(number of torchrun nodes, [(label, pod spec, container)]) of a training CRD."""
    pods = []
    if doc["kind"] == "PyTorchJob":
        nodes = 0
        for rtype, rspec in doc["spec"]["pytorchReplicaSpecs"].items():
            nodes += rspec["replicas"]
            spec = rspec["template"]["spec"]
            (container,) = [c for c in spec["containers"] if c["name"] == "pytorch"]
            pods.append((rtype, spec, container))
        return nodes, pods
    nodes = 0
    for rj in doc["spec"]["replicatedJobs"]:
        job = rj["template"]["spec"]
        assert job.get("completionMode") == "Indexed", "pod DNS names need an Indexed Job"
        assert job["parallelism"] == job["completions"], "all nodes must run at once"
        nodes += rj.get("replicas", 1) * job["parallelism"]
        spec = job["template"]["spec"]
        assert len(spec["containers"]) == 1
        pods.append((rj["name"], spec, spec["containers"][0]))
    return nodes, pods


def container_argv(container: dict) -> list[str]:
    return list(container.get("command") or []) + list(container.get("args") or [])


def torchrun_argv(container: dict, tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    """The torchrun command line the container runs (after any shell wrapper).

    A ``bash -c`` wrapper is really executed, with a fake ``torchrun`` on PATH
    that prints its arguments, so shell mistakes show up here.
    """
    argv = container_argv(container)
    if argv and argv[0] == "torchrun":
        return argv
    assert argv[:2] in (["bash", "-c"], ["sh", "-c"]), f"unexpected command {argv[:2]}"
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    fake = bindir / "torchrun"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(['torchrun'] + sys.argv[1:]))\n")
    fake.chmod(0o755)
    run_env = {"PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    proc = subprocess.run(argv, env=run_env, cwd=tmp_path, capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_options(argv: list[str], valueless: set[str] = frozenset()) -> tuple[dict[str, str], list[str]]:
    """``--opt value`` / ``--opt=value`` pairs and positionals (no repeats allowed)."""
    opts: dict[str, str] = {}
    positional: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            key, eq, val = a.partition("=")
            if not eq:
                if key in valueless:
                    val = ""
                else:
                    i += 1
                    val = argv[i]
            assert key not in opts, f"{key} given twice"
            opts[key] = val
        else:
            positional.append(a)
        i += 1
    return opts, positional


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?|k|m)?$")
_FACTORS = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(q) -> float:
    m = _QUANTITY.match(str(q))
    assert m, f"not a quantity: {q!r}"
    return float(m.group(1)) * _FACTORS[m.group(2)]


def serve_parts() -> tuple[dict, dict, dict, dict, dict]:
    sts = one("serve-statefulset.yaml", "StatefulSet")
    svc = one("serve-statefulset.yaml", "Service")
    secret = one("serve-secret.example.yaml", "Secret")
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return sts, svc, secret, pod, container


def serve_flags(container: dict) -> dict[str, str]:
    argv = container_argv(container)
    assert argv[:2] == ["tensorwire", "serve"], argv
    opts, positional = parse_options(argv[2:], VALUELESS_FLAGS)
    assert not positional, positional
    return opts


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeatable keys, backslash continuations."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line[0] in "#;"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, eq, value = line.partition("=")
        assert eq, f"{path}: not key=value: {line}"
        current.setdefault(key.strip(), []).append(value.strip())
    assert not pending, f"{path}: dangling continuation"
    return sections


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs; comments dropped, continuations joined."""
    out = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending
    return out


# --------------------------------------------------------------------------- schema validation


def test_manifests_hold_the_expected_objects():
    for name, kinds in MANIFESTS.items():
        docs = load_docs(name)
        assert {d["kind"] for d in docs} == kinds, name
        for d in docs:
            assert d["apiVersion"] and d["metadata"]["name"], name
    assert sorted(p.name for p in K8S.glob("*.yaml")) == sorted(MANIFESTS), "a manifest is not covered by the tests"


CORE_DOCS = [item for item in all_docs() if item[1]["kind"] not in CRD_SCHEMAS]
CRD_DOCS = [item for item in all_docs() if item[1]["kind"] in CRD_SCHEMAS]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", CORE_DOCS, ids=doc_id)
def test_core_objects_validate_strict(item, version):
    _, doc = item
    kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("item", CRD_DOCS, ids=doc_id)
def test_crds_validate_against_their_schema(item):
    _, doc = item
    schema = load_schema(doc["kind"])
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(doc)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", CRD_DOCS, ids=doc_id)
def test_crd_embedded_templates_validate_strict(item, version):
    _, doc = item
    embedded = crd_embedded_objects(doc)
    assert len(embedded) >= 2  # metadata + at least one template
    for where, obj in embedded:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:  # pragma: no cover - message for humans
            pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")


def test_strict_validation_rejects_a_typo():
    sts = one("serve-statefulset.yaml", "StatefulSet")
    kv.validate(sts, K8S_VERSIONS[0], strict=True)
    broken = copy.deepcopy(sts)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSIONS[0], strict=True)


def test_validation_rejects_a_wrong_type():
    sts = copy.deepcopy(one("serve-statefulset.yaml", "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, K8S_VERSIONS[0], strict=False)


def test_embedded_pod_template_typo_is_rejected():
    job = one("pytorchjob.yaml", "PyTorchJob")
    broken = copy.deepcopy(job)
    container = broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    # A fresh dict: the YAML anchors make both replicas share one securityContext.
    container["securityContext"] = {"capabilities": {"adds": ["IPC_LOCK"]}}
    errors = []
    for where, obj in crd_embedded_objects(broken):
        try:
            kv.validate(obj, K8S_VERSIONS[0], strict=True)
        except kv.ValidationError:
            errors.append(where)
    assert errors == ["pytorchReplicaSpecs.Worker.template"]


@pytest.mark.parametrize(
    "kind, mutate",
    [
        ("PyTorchJob", lambda d: d["spec"].__setitem__("pytorchReplicaSpec", d["spec"].pop("pytorchReplicaSpecs"))),
        ("PyTorchJob", lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].__setitem__("replicas", -1)),
        (
            "PyTorchJob",
            lambda d: d["spec"]["pytorchReplicaSpecs"].__setitem__(
                "Leader", d["spec"]["pytorchReplicaSpecs"]["Worker"]
            ),
        ),
        (
            "PyTorchJob",
            lambda d: d["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].__setitem__(
                "name", "main"
            ),
        ),
        ("JobSet", lambda d: d["spec"].__setitem__("replicatedJob", d["spec"].pop("replicatedJobs"))),
        ("JobSet", lambda d: d["spec"]["network"].__setitem__("subdomain", "Not_A_DNS_Label")),
        ("JobSet", lambda d: d["spec"]["successPolicy"].__setitem__("operator", "Most")),
    ],
    ids=[
        "spec-typo",
        "negative-replicas",
        "unknown-replica-type",
        "container-not-pytorch",
        "jobset-spec-typo",
        "bad-subdomain",
        "bad-enum",
    ],
)
def test_crd_schemas_reject_broken_objects(kind, mutate):
    (item,) = [i for i in CRD_DOCS if i[1]["kind"] == kind]
    broken = copy.deepcopy(item[1])
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(load_schema(kind)).validate(broken)


@pytest.mark.parametrize("item", CRD_DOCS, ids=doc_id)
def test_crds_are_not_known_to_kubernetes_validate(item):
    # Why deploy/k8s/schemas exists: the bundled schemas cover core APIs only.
    with pytest.raises(kv.SchemaNotFoundError):
        kv.validate(item[1], K8S_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------- training jobs


@pytest.mark.parametrize("item", CRD_DOCS, ids=doc_id)
def test_torchrun_shape_matches_replicas_and_gpus(item, tmp_path):
    _, doc = item
    nodes, pods = training_pods(doc)
    assert nodes >= 2, "a multi-node example"
    for label, _spec, container in pods:
        opts, positional = parse_options(torchrun_argv(container, tmp_path, {"JOB_COMPLETION_INDEX": "0"})[1:])
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus >= 1, label
        assert int(opts["--nnodes"]) == nodes, label
        assert int(opts["--nproc-per-node"]) == gpus, label
        assert opts["--rdzv-backend"] == "c10d", label
        assert opts["--rdzv-id"], label
        assert positional == [TRAIN_SCRIPT], label
        if doc["kind"] == "PyTorchJob":
            assert doc["spec"]["nprocPerNode"] == str(gpus)


def test_pytorchjob_rendezvous_goes_through_the_master_service(tmp_path):
    job = one("pytorchjob.yaml", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1
    # The operator names the master's headless Service <job>-master-0 and exposes
    # the port named pytorchjob-port of the master's "pytorch" container.
    master = [c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch"][0]
    ports = {p["name"]: p["containerPort"] for p in master["ports"]}
    assert ports["pytorchjob-port"] == RDZV_PORT
    for _label, _spec, container in training_pods(job)[1]:
        opts, _ = parse_options(torchrun_argv(container, tmp_path)[1:])
        assert opts["--rdzv-endpoint"] == f"{job['metadata']['name']}-master-0:{RDZV_PORT}"


def test_jobset_rendezvous_goes_through_its_headless_service(tmp_path):
    js = one("jobset.yaml", "JobSet")
    svc = one("jobset.yaml", "Service")
    name = js["metadata"]["name"]
    network = js["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    assert svc["metadata"]["name"] == network["subdomain"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": name}
    assert [p["port"] for p in svc["spec"]["ports"]] == [RDZV_PORT]
    (rj,) = js["spec"]["replicatedJobs"]
    container = rj["template"]["spec"]["template"]["spec"]["containers"][0]
    assert RDZV_PORT in [p["containerPort"] for p in container["ports"]]
    # Pod 0 of job 0 hosts the store; its DNS name is <jobset>-<rjob>-0-0.<subdomain>.
    expected = f"{name}-{rj['name']}-0-0.{network['subdomain']}:{RDZV_PORT}"
    hosts = {}
    for index in range(rj["template"]["spec"]["parallelism"]):
        opts, _ = parse_options(torchrun_argv(container, tmp_path, {"JOB_COMPLETION_INDEX": str(index)})[1:])
        assert opts["--rdzv-endpoint"] == expected
        hosts[index] = opts["--rdzv-conf"]
    assert hosts[0] == "is_host=1"
    assert all(v == "is_host=0" for i, v in hosts.items() if i != 0)


def test_torchrun_accepts_the_command_lines(tmp_path, monkeypatch):
    run = pytest.importorskip("torch.distributed.run")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it
    for _name, doc in CRD_DOCS:
        nodes, pods = training_pods(doc)
        for index in range(nodes):
            for _label, _spec, container in pods:
                argv = torchrun_argv(container, tmp_path, {"JOB_COMPLETION_INDEX": str(index)})
                args = run.parse_args(argv[1:])
                config, _cmd, cmd_args = run.config_from_args(args)
                assert (config.min_nodes, config.max_nodes) == (nodes, nodes)
                assert config.nproc_per_node == int(container["resources"]["limits"]["nvidia.com/gpu"])
                assert args.training_script == TRAIN_SCRIPT and not args.training_script_args
                assert cmd_args[-1] == TRAIN_SCRIPT
                params = RendezvousParameters(
                    backend=config.rdzv_backend,
                    endpoint=config.rdzv_endpoint,
                    run_id=config.run_id,
                    min_nodes=config.min_nodes,
                    max_nodes=config.max_nodes,
                    **config.rdzv_configs,
                )
                if doc["kind"] == "JobSet":
                    assert params.get_as_bool("is_host") is (index == 0)


@pytest.mark.parametrize("item", CRD_DOCS, ids=doc_id)
def test_training_pods_have_rdma_and_ucx_settings(item):
    _, doc = item
    for label, spec, container in training_pods(doc)[1]:
        check_rdma_pod(label, spec, container)
        assert container["workingDir"] == dockerfile_workdir()


def check_rdma_pod(label: str, spec: dict, container: dict) -> None:
    limits = container["resources"]["limits"]
    rdma = {k: v for k, v in limits.items() if k.startswith("rdma/") or k == "nvidia.com/hca"}
    assert rdma and all(int(v) >= 1 for v in rdma.values()), f"{label}: no RDMA device resource"
    assert quantity(limits["memory"]) > 0, label
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], label
    env = env_of(container)
    assert env["TENSORWIRE_TRANSPORT"] == "auto", label
    tls = env["UCX_TLS"].split(",")
    assert {"rc", "tcp", "cuda_copy", "cuda_ipc"} <= set(tls), f"{label}: UCX_TLS={env['UCX_TLS']}"
    assert re.fullmatch(r"[a-z0-9_]+:\d+(,[A-Za-z0-9_.:]+)*", env["UCX_NET_DEVICES"]), label
    assert "expandable_segments:true" not in (env.get("PYTORCH_CUDA_ALLOC_CONF") or "").lower(), label
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes[mounts["/dev/shm"]]
    assert shm["emptyDir"]["medium"] == "Memory", label


# --------------------------------------------------------------------------- serve daemon


def test_serve_runs_the_documented_command():
    *_, container = serve_parts()
    flags = serve_flags(container)
    assert set(flags) <= SERVE_FLAGS, set(flags) - SERVE_FLAGS
    for flag, value in EXPECTED_SERVE_FLAGS.items():
        assert flags[flag] == value, flag
    env_flags = {n for n in env_of(container) if n.startswith("TENSORWIRE_")}
    assert env_flags <= ENV_NAMES, env_flags - ENV_NAMES
    # Each setting in one place: no flag both on the command line and in env.
    assert not {f for f in flags if "TENSORWIRE_" + f[2:].upper().replace("-", "_") in env_flags}


def test_serve_flags_parse_with_the_real_cli():
    pytest.importorskip("tensorwire.serve.cli")
    from tensorwire.cli import build_parser

    *_, container = serve_parts()
    args = build_parser().parse_args(container_argv(container)[1:])
    assert args.command == "serve" and callable(args.func)


def test_serve_probes_use_grpc_health_on_the_control_port():
    *_, container = serve_parts()
    port = int(serve_flags(container)["--port"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == port, probe
        assert set(container[probe]) & {"httpGet", "tcpSocket", "exec"} == set(), probe


def test_serve_ports_service_and_labels_agree():
    sts, svc, _secret, pod, container = serve_parts()
    flags = serve_flags(container)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": int(flags["--port"]),
        "data": int(flags["--data-port"]),
        "metrics": int(flags["--metrics-port"]),
    }
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None"
    labels = pod["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for p in svc["spec"]["ports"]:
        assert ports[p["targetPort"]] == p["port"], p


def test_serve_token_comes_from_the_secret():
    _sts, _svc, secret, pod, container = serve_parts()
    token_file = Path(serve_flags(container)["--token-file"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(token_file.parent)]
    assert mount["readOnly"] is True
    volume = {v["name"]: v for v in pod["spec"]["volumes"]}[mount["name"]]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    items = {i["key"]: i["path"] for i in volume["secret"]["items"]}
    key = [k for k, path in items.items() if path == token_file.name]
    assert key and key[0] in {**secret.get("data", {}), **secret.get("stringData", {})}


def test_serve_snapshots_live_on_a_claim():
    sts, _svc, _secret, _pod, container = serve_parts()
    snapdir = serve_flags(container)["--snapshot-dir"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {c["metadata"]["name"]: c for c in sts["spec"]["volumeClaimTemplates"]}
    claim = claims[mounts[snapdir]]
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) >= 2**30


def test_serve_resources_security_and_metrics():
    _sts, _svc, _secret, pod, container = serve_parts()
    check_rdma_pod("serve", pod["spec"], container)
    flags = serve_flags(container)
    limits = container["resources"]["limits"]
    assert quantity(container["resources"]["requests"]["memory"]) <= quantity(limits["memory"])
    max_bytes = int(env_of(container)["TENSORWIRE_MAX_BYTES"])
    assert 0 < max_bytes < quantity(limits["memory"]), "the daemon's store must fit in its memory limit"
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == flags["--metrics-port"]
    assert ann["prometheus.io/path"].startswith("/")
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 30


def test_no_manifest_enables_expandable_segments():
    for name, doc in all_docs():
        text = json.dumps(doc).lower()
        assert "expandable_segments:true" not in text, name
    for path in (SERVE_ENV, DOCKERFILE):
        active = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
        assert "expandable_segments:true" not in "\n".join(active).lower(), path


# --------------------------------------------------------------------------- systemd


def test_systemd_unit_has_the_required_settings():
    unit = parse_unit(UNIT)
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["Restart"] == "on-failure"
    assert "-/etc/tensorwire/serve.env" in unit["Service"]["EnvironmentFile"]
    assert svc["KillSignal"] == "SIGTERM"
    assert svc["TimeoutStopSec"] == "30"
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert "/var/lib/tensorwire" in " ".join(unit["Service"]["ReadWritePaths"]).split()
    assert svc.get("DynamicUser") == "yes" or svc.get("User") not in (None, "", "root")
    # Settings that hide GPU / RDMA device nodes must stay off.
    for key in ("PrivateDevices", "ProtectClock", "DevicePolicy", "DeviceAllow"):
        assert svc.get(key, "no") in ("no", "false"), key
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]

    argv = shlex.split(svc["ExecStart"])
    assert argv[:3] == ["/usr/bin/env", "tensorwire", "serve"]
    flags, positional = parse_options(argv[3:], VALUELESS_FLAGS)
    assert not positional and set(flags) <= SERVE_FLAGS
    assert flags["--snapshot-dir"] == "/var/lib/tensorwire"
    assert flags["--snapshot-dir"] == "/var/lib/" + svc["StateDirectory"]
    for flag in ("--host", "--port", "--data-port", "--metrics-port"):
        assert flags[flag] == EXPECTED_SERVE_FLAGS[flag], flag
    # The token arrives as a credential named after the file ExecStart reads.
    cred_name, _, cred_src = svc["LoadCredential"].partition(":")
    assert flags["--token-file"] == "${CREDENTIALS_DIRECTORY}/" + cred_name
    assert cred_src == "/etc/tensorwire/token"


def _verify(path: Path) -> list[str]:
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [ln for ln in (proc.stdout + proc.stderr).splitlines() if path.name in ln]
    if proc.returncode != 0:
        problems.append(f"exit {proc.returncode}: {proc.stderr.strip()}")
    return problems


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path):
    assert _verify(UNIT) == []
    # ... and it does complain about a broken copy, so the check above is live.
    broken = tmp_path / UNIT.name
    broken.write_text(UNIT.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    assert any("sometimes" in p for p in _verify(broken))


def test_serve_env_example():
    seen = set()
    for raw in SERVE_ENV.read_text().splitlines():
        line = raw.strip()
        if not line:
            continue
        commented = line.startswith("#")
        body = line.lstrip("#").strip()
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(\S*)", body)
        if commented and not m:
            continue  # prose
        assert m, f"not VAR=value: {raw!r}"
        name = m.group(1)
        assert name.startswith(("TENSORWIRE_", "UCX_")), name
        if name.startswith("TENSORWIRE_"):
            assert name in ENV_NAMES, f"{name} is no tensorwire serve flag"
        if not commented:
            seen.add(name)
    assert {"TENSORWIRE_TRANSPORT", "UCX_TLS", "UCX_NET_DEVICES"} <= seen
    assert not any(ln.startswith("export ") for ln in SERVE_ENV.read_text().splitlines())


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_workdir() -> str:
    return [a for i, a in dockerfile_instructions(DOCKERFILE) if i == "WORKDIR"][-1]


def test_dockerfile_builds_a_cuda_pytorch_image_with_ucx_and_rdma():
    ins = dockerfile_instructions(DOCKERFILE)
    args = dict(a.split("=", 1) for i, a in ins if i == "ARG" and "=" in a)
    froms = [a for i, a in ins if i == "FROM"]
    assert froms == ["${BASE_IMAGE}"]
    base = args["BASE_IMAGE"]
    assert "cuda" in base and "pytorch" in base, base
    runs = [a for i, a in ins if i == "RUN"]
    apt = next(r for r in runs if "apt-get install" in r)
    for pkg in ("rdma-core", "libibverbs1", "ibverbs-providers", "librdmacm1"):
        assert re.search(rf"(^|\s){re.escape(pkg)}(\s|$)", apt), pkg
    pip = next(r for r in runs if "pip install" in r)
    assert "type=bind,source=." in pip and "[${TENSORWIRE_EXTRAS}]" in pip
    assert args["TENSORWIRE_EXTRAS"], "an extra with the UCX wheel"
    cuda_major = re.search(r"cuda(\d+)", base).group(1)
    assert args["TENSORWIRE_EXTRAS"] == f"cu{cuda_major}", "UCX wheel must match the base image's CUDA"
    exposed = {p for i, a in ins if i == "EXPOSE" for p in a.split()}
    assert exposed == {"7100", "7101", "9100"}
    entry = json.loads(next(a for i, a in ins if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in ins if i == "CMD"))
    assert entry[0].endswith("tini") and cmd[:2] == ["tensorwire", "serve"]
    opts, positional = parse_options(cmd[2:], VALUELESS_FLAGS)
    assert opts == EXPECTED_SERVE_FLAGS and not positional
    workdir = dockerfile_workdir()
    copies = [a.split() for i, a in ins if i == "COPY"]
    assert ["examples/", f"{workdir}/examples/"] in copies
    assert (ROOT / "deploy" / "Dockerfile.dockerignore").is_file()
    for pattern in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        assert pattern.strip() not in {"examples", "tensorwire", "pyproject.toml", "*", "**"}


def test_dockerfile_extra_exists_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("no pyproject.toml yet")
    extras = tomllib.loads(pyproject.read_text()).get("project", {}).get("optional-dependencies", {})
    args = dict(a.split("=", 1) for i, a in dockerfile_instructions(DOCKERFILE) if i == "ARG" and "=" in a)
    assert args["TENSORWIRE_EXTRAS"] in extras, sorted(extras)


def test_dockerfile_documents_the_run_flags():
    comments = "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if ln.lstrip().startswith("#"))
    for flag in (
        "--ipc=host",
        "--ulimit memlock=-1",
        "--device /dev/infiniband",
        "--cap-add IPC_LOCK",
        "--network host",
        "--shm-size",
    ):
        assert flag in comments, flag


# --------------------------------------------------------------------------- README


def test_readme_covers_the_ucx_settings_and_the_files():
    text = (DEPLOY / "README.md").read_text()
    for needle in (
        "UCX_TLS",
        "UCX_NET_DEVICES",
        "UCX_IB_GPU_DIRECT_RDMA",
        "UCX_RNDV_THRESH",
        "UCX_MEMTYPE_CACHE",
        "UCX_MAX_RNDV_RAILS",
        "UCX_IB_GID_INDEX",
        "memlock",
        "--ipc=host",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "rc,tcp,sm,self,cuda_copy,cuda_ipc",
        "tcp,sm,self,cuda_copy,cuda_ipc",
    ):
        assert needle in text, needle
    for ref in re.findall(r"`((?:k8s|systemd)/[\w./-]+|Dockerfile)`", text):
        assert (DEPLOY / ref).exists(), ref


def test_serve_runs_three_daemons_and_the_example_client_reaches_them_through_dns():
    sts, svc, _secret, _pod, _container = serve_parts()
    assert sts["spec"]["replicas"] == 3 and svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    job = one("serve-client.example.yaml", "Job")
    (client,) = job["spec"]["template"]["spec"]["containers"]
    address = {e["name"]: e["value"] for e in client["env"]}["TENSORWIRE_SERVE_ADDRESS"]
    m = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", address)
    assert m, address
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert m.group(1) == svc["metadata"]["name"] and int(m.group(3)) == grpc_port
    # the client reads the token the daemons check, and its address is what tensorwire resolves
    secrets = [v["secret"]["secretName"] for v in job["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secrets == ["tensorwire-token"]
    from tensorwire.serve.client.sharding import DNS_SCHEME

    assert address.startswith(DNS_SCHEME) and 'shard="rows"' in client["args"][-1]
