"""`make deploy-test`: the compose deployment for real, on this host's network, end to end.

    python -m tests.deploy.run_compose [--docker /usr/bin/docker] [--image tandem:cpu]

With the image built (`make image`), it brings up the shm holder, the worker, the scheduler and
two tokenizers from docker-compose.yml + docker-compose.host.yml under a project of its own and
waits on their health checks, then:

1. streams requests through the public port and each tokenizer's own port, and checks their
   text and token ids against `tandem run` in the worker's container (the same image and CPU);
2. scrapes every /metrics that prometheus/prometheus.host.yml names;
3. waits until one request's spans from all three stages reach an OTLP receiver of its own;
4. kills the worker's process (SIGKILL, inside its container) during a stream: the stream must
   end UNAVAILABLE, the restart policy bring the container back, the next request succeed, the
   dead worker's segments be reaped and no live stage's (worker_crash.py);
5. stops the stages (each must exit 0 on SIGTERM), checks inside the IPC namespace that no
   tandem segment is left, and `docker compose down`s: no container, no volume left.

Whatever happens, the project is brought down. Exit status 0 only if every check held; the
measurements (cold start, kill to recovery, image size) are printed and written to
out/deploy-test.json. The pieces: compose_cli.py (docker compose, time-boxed), live_stack.py
(ports, logs, progress), streams.py (Generate calls on threads), worker_crash.py (step 4),
shm_probe.py (run inside the containers).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.compose_cli import CommandFailed, Compose, image_layers, now
from tests.deploy.compose_local import ROOT
from tests.deploy.live_stack import (
    COLD_START_MARKS,
    STAGES,
    Ports,
    check,
    free_ports,
    read_ports,
    say,
    timeline,
)
from tests.deploy.streams import MAX_TOKENS, generate, request
from tests.deploy.worker_crash import crash_the_worker
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

PROJECT = "tandem-deploy-test"
PROMPTS = (("text", "The capital of France is"), ("chat", "Name a famous bridge in San Francisco."))
UP_TIMEOUT_S = 600  # a cold start compiles the worker's CPU kernels
SPAN_WAIT_S = 60
RESULTS = ROOT / "out" / "deploy-test.json"


def bring_up(compose: Compose, results: dict[str, Any]) -> None:
    say("docker compose up: shm holder, worker, scheduler, two tokenizers (host network)")
    started = now()
    compose.stream(
        "up",
        "-d",
        "--no-build",
        "--wait",
        "--wait-timeout",
        str(UP_TIMEOUT_S),
        "shm",
        *STAGES,
        timeout=UP_TIMEOUT_S + 60,
    )
    results["cold_start_to_healthy_s"] = round(now() - started, 1)
    results["cold_start_started_at"] = started
    say(f"all healthy {results['cold_start_to_healthy_s']} s after `up`")


def first_token(compose: Compose, ports: Ports, results: dict[str, Any]) -> None:
    got = generate(ports.public, request("chat", "Hello!", max_tokens=8))
    check(got.error is None and got.first_token_at > 0, f"the first request failed: {got.status()}")
    started = results.pop("cold_start_started_at")
    results["cold_start_to_first_token_s"] = round(got.first_token_at - started, 1)
    say(f"first token {results['cold_start_to_first_token_s']} s after `up`: {got.text!r}")
    results["cold_start_timeline_s"] = timeline(compose, started, COLD_START_MARKS)
    say(f"where the cold start went (s after `up`): {results['cold_start_timeline_s']}")


def check_text(compose: Compose, ports: Ports) -> str:
    """Each prompt's streamed text equals `tandem run`'s; returns one request's trace id."""
    trace_id = ""
    for kind, prompt in PROMPTS:
        argv = ["--chat"] if kind == "chat" else []
        done = compose.run(
            "exec",
            "-T",
            "worker",
            "tandem",
            "run",
            "--json",
            *argv,
            "--prompt",
            prompt,
            "--max-tokens",
            str(MAX_TOKENS),
            timeout=180,
        )
        want = json.loads(done.stdout.strip().splitlines()[-1])
        addresses = {"public port": ports.public, **ports.own}
        for where, address in addresses.items():
            got = generate(address, request(kind, prompt))
            check(got.error is None, f"{kind} prompt through {where}: {got.status()}")
            check(got.prompt_ids == want["prompt_token_ids"], f"{kind} prompt ids differ ({where})")
            check(
                got.token_ids == want["token_ids"] and got.text == want["text"],
                f"{kind} prompt through {where}: {got.text!r}, tandem run: {want['text']!r}",
            )
            check(got.finish_reason == want["finish_reason"], f"finish reason differs ({where})")
            trace_id = trace_id or got.trace_id
        text = http_text(ports.http, kind, prompt)
        check(
            text == want["text"], f"{kind} prompt over HTTP: {text!r}, tandem run: {want['text']!r}"
        )
        say(
            f"{kind} prompt: the same {len(want['token_ids'])} tokens as `tandem run` "
            f"through {', '.join(addresses)} and the HTTP API: {want['text']!r}"
        )
    return trace_id


def http_text(address: str, kind: str, prompt: str) -> str:
    """The greedy text of one request to the OpenAI-compatible API, as any HTTP client sends it."""
    with urllib.request.urlopen(f"http://{address}/v1/models", timeout=30) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    post = urllib.request.Request(
        f"http://{address}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(post, timeout=120) as reply:
        choice = json.loads(reply.read())["choices"][0]
    return str(choice["message"]["content"] if kind == "chat" else choice["text"])


def scrape(target: str) -> dict[str, float]:
    """Sample name -> its value summed over labels, from one live /metrics."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def check_metrics(ports: Ports) -> None:
    # Both tokenizers served requests above, and every request ran steps.
    served_something = {
        "tandem-tokenizer": "tandem_request_success_total",
        "tandem-scheduler": "tandem_scheduler_steps_total",
        "tandem-worker": "tandem_step_duration_seconds_count",
    }
    for job, targets in ports.metrics.items():
        for target in targets:
            samples = scrape(target)
            check(any(n.startswith("tandem_") for n in samples), f"{target}: no tandem_ metric")
            wanted = served_something[job]
            check(samples.get(wanted, 0) > 0, f"{target}: {wanted} is 0")
    say(
        f"metrics: {sum(len(t) for t in ports.metrics.values())} endpoints scraped: "
        f"{', '.join(t for ts in ports.metrics.values() for t in ts)}"
    )


def check_traces(receiver: OtlpReceiver, trace_id: str) -> None:
    wanted = {"tandem-tokenizer", "tandem-scheduler", "tandem-worker"}

    def complete(spans: list[ReceivedSpan]) -> bool:
        return wanted <= {s.service for s in spans if s.trace_id == trace_id}

    spans = receiver.wait_for(complete, SPAN_WAIT_S)
    mine = sorted({(s.service, s.name) for s in spans if s.trace_id == trace_id})
    say(f"trace {trace_id}: {len(mine)} kinds of span from three containers: {mine}")


def stop_and_down(compose: Compose) -> None:
    compose.run("stop", *STAGES, timeout=180)
    codes = {s: compose.inspect(s)["State"]["ExitCode"] for s in STAGES}
    check(all(code == 0 for code in codes.values()), f"exit codes on SIGTERM: {codes}")
    left = compose.run("exec", "-T", "shm", "ls", "-a", "/dev/shm", timeout=30).stdout.split()
    ours = [n for n in left if n.startswith(("tandem-", "sem.tandem-"))]
    check(not ours, f"left in the IPC namespace after the stages stopped: {ours}")
    say(f"stages stopped on SIGTERM, exit codes {codes}; /dev/shm of the IPC namespace: {left}")
    compose.down()
    check(not compose.containers(), f"containers left: {compose.containers()}")
    check(not compose.volumes(), f"volumes left: {compose.volumes()}")
    say("docker compose down: no container and no volume of the project left")


def run(compose: Compose, receiver: OtlpReceiver, image: str, results: dict[str, Any]) -> None:
    size, layers = image_layers(compose.docker, image)
    results["image"] = {"name": image, "bytes": size, "layers": layers}
    say(f"image {image}: {size / 1e9:.2f} GB")
    compose.down()  # whatever an interrupted earlier run of this test left
    ports = read_ports(compose)
    free_ports(ports)
    bring_up(compose, results)
    first_token(compose, ports, results)
    trace_id = check_text(compose, ports)
    check_metrics(ports)
    check_traces(receiver, trace_id)
    crash_the_worker(compose, ports, results)
    stop_and_down(compose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.run_compose", description=__doc__)
    parser.add_argument("--docker", default="docker", help="the docker CLI (here /usr/bin/docker)")
    parser.add_argument("--image", default="tandem:cpu", help="the CPU image, built beforehand")
    args = parser.parse_args(argv)
    receiver = OtlpReceiver().start()
    compose = Compose(
        args.docker,
        PROJECT,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "TANDEM_IMAGE": args.image},
    )
    results: dict[str, Any] = {}
    failed = False
    try:
        run(compose, receiver, args.image, results)
    except Exception as err:  # any failure: report it, then bring the project down
        failed = True
        print(f"\nFAILED: {err}", file=sys.stderr, flush=True)
        traceback.print_exc()
        print(compose.logs(STAGES), file=sys.stderr)
    finally:
        try:
            compose.down()
        except CommandFailed as err:
            failed = True
            print(f"FAILED to bring the project down: {err}", file=sys.stderr)
        receiver.stop()
    results["passed"] = not failed
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    summary = {k: v for k, v in results.items() if k != "image"}
    say(f"{'PASSED' if not failed else 'FAILED'}: {json.dumps(summary)} (all in {RESULTS})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
