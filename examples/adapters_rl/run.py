"""Per-tenant LoRA adapters trained online from each tenant's live users, on one shared base, on CPU.

One ``stream-gateway up`` serves the ``tiny`` base model with two LoRA adapters, ``alpha`` and
``beta`` (``--lora``), and a key file binds tenant alpha's key to ``alpha`` and tenant beta's to
``beta``. Each tenant's simulated users (online_rl's :mod:`simulated_users`, with the tenant's key
and reward) talk to the gateway without pause; alpha's users reward digits, beta's punctuation
(:mod:`tenants`). One batcher per adapter (``stream-gateway batch --adapter NAME``) turns that
adapter's rated sessions into GRPO batches, and one trainer per adapter (:mod:`lora_trainer`:
online_rl's GRPO step, verl's own functions, on the adapter's LoRA weights only) publishes each
step as the adapter's next version (``publish_policy(..., adapter=NAME)``), which the gateway
applies between two decode steps. A third key, bound to nothing, talks to the base model as a
control. At the end: CSVs, a plot and a summary (:mod:`report`), including leakage: each
tenant's replies scored with the other tenant's reward.

    .venv/bin/python examples/adapters_rl/run.py [--steps 80] [--duration 600] [--users 6] [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import httpx

# online_rl's modules (the gateway child, the users, the GRPO step, the CSV) are imported from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "online_rl"))

from gateway_process import GatewayProcess, gateway_command, prepare_model, running_gateway
from lora_trainer import ATTENTION_AND_MLP, LoraGrpoTrainer, make_initial_adapter
from report import AdapterRun, format_summary, write_csvs, write_plot
from run_report import StepRow, read_policy_events
from simulated_users import UserTraffic
from tenants import ALPHA, BASE, BETA, TENANTS, Scorer, Tenant, write_key_file

__all__ = ["main"]

_BATCH_TIMEOUT_S = 180.0  # the longest wait for one batch before giving up
_TRAINED = (ALPHA, BETA)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve().parent
    parser.add_argument("--steps", type=int, default=80, help="training steps per adapter = its versions (80)")
    parser.add_argument(
        "--duration", type=float, default=600.0, help="stop training after this many seconds, steps left or not (600)"
    )
    parser.add_argument("--users", type=int, default=6, help="concurrent simulated users per tenant (6)")
    parser.add_argument("--base-users", type=int, default=2, help="users of the unbound control key (2; 0: none)")
    parser.add_argument("--out", type=Path, default=here / "out", help="results directory (default: out/ here)")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO group size: sessions per conversation (4)")
    parser.add_argument("--batch-size", type=int, default=16, help="trajectories per training step (16)")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate of the adapters (3e-2)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r (8); lora_alpha is 2r")
    parser.add_argument(
        "--targets",
        default=",".join((*ATTENTION_AND_MLP, "lm_head")),
        help="LoRA target modules, comma-separated (default: the attention and MLP projections and lm_head)",
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="completion tokens per turn (24)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the adapters, the conversations and the trainers")
    parser.add_argument("--data-dir", type=Path, help="keep NATS data, adapters and batches here (default: a temp dir)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example, write the results, print the summary; 0 if the users saw no errors."""
    begun = time.monotonic()
    args = _parser().parse_args(argv)
    if args.batch_size % args.group_size:
        raise SystemExit("--batch-size must be a multiple of --group-size")
    if args.data_dir is not None and args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise SystemExit(f"--data-dir {args.data_dir} is not empty: old batches and adapter versions would mix in")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # four "Loading weights" bars of a 1 MB model
    run = anyio.run(_run, args)
    files = write_csvs(out, run)
    png = out / "adapters_rl.png"
    write_plot(
        png,
        run,
        f"Two tenants, one base ({run.model}): a LoRA adapter each (r {args.rank}), trained from its own users "
        f"({args.users} per tenant), GRPO batches of {args.batch_size}, lr {args.lr:g}",
    )
    summary_path = out / "summary.txt"
    summary = format_summary(run, wall_s=time.monotonic() - begun, files=(*files, png, summary_path, *run.logs))
    summary_path.write_text(summary.lstrip("\n") + "\n")
    print(summary, flush=True)
    return 0 if run.errors == 0 else 1


@dataclass(slots=True)
class _Tenant:
    """A tenant's live parts during the run."""

    tenant: Tenant
    traffic: UserTraffic
    scorer: Scorer
    trainer: LoraGrpoTrainer | None = None
    batch_dir: Path | None = None


async def _run(args: argparse.Namespace) -> AdapterRun:
    out: Path = args.out
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    say("preparing model 'tiny'")
    model_dir = await prepare_model("tiny")
    with tempfile.TemporaryDirectory(prefix="adapters-rl-") as scratch:
        data_dir = args.data_dir or Path(scratch) / "data"
        work = Path(scratch)
        adapters = {t.adapter: work / "adapters" / str(t.adapter) for t in _TRAINED}
        for index, (name, directory) in enumerate(adapters.items()):
            make = partial(make_initial_adapter, rank=args.rank, alpha=2 * args.rank, targets=targets)
            await anyio.to_thread.run_sync(partial(make, model_dir, directory, seed=args.seed + index))
            say(f"adapter {name!r}: PEFT LoRA r {args.rank} on {', '.join(targets)} (lora_B zero: = the base)")
        key_file = work / "keys.txt"
        write_key_file(key_file)
        trainers = {
            t.adapter: await anyio.to_thread.run_sync(
                partial(
                    LoraGrpoTrainer,
                    model_dir,
                    adapters[t.adapter],
                    lr=args.lr,
                    group_size=args.group_size,
                    batch_size=args.batch_size,
                    seed=args.seed,
                )
            )
            for t in _TRAINED
        }
        users_total = len(_TRAINED) * args.users + args.base_users
        up_flags = [
            *(f"--lora={name}={directory}" for name, directory in adapters.items()),
            "--api-key-file", str(key_file),
            "--base",  # up's own batcher takes the base model's trajectories only: those of tenant-base
            "--batch-size", str(args.batch_size),
            "--group-size", str(args.group_size),
            "--idle-timeout", "10",  # a session abandoned mid-way still leaves within seconds
            "--max-batch-size", str(max(16, users_total)),  # every user's turn decodes in one batch
            "--log-level", "warning",
        ]  # fmt: skip
        say(f"starting stream-gateway up (log: {out / 'gateway.log'})")
        async with running_gateway(
            model="tiny", data_dir=data_dir, log_path=out / "gateway.log", up_flags=up_flags
        ) as gateway:
            say(f"gateway at {gateway.base_url}, NATS at {gateway.nats_url}; tenants: {key_file.read_text()!r}")
            started, started_unix = time.monotonic(), time.time()
            live = _live_tenants(args, gateway, trainers, data_dir, started)
            rows: dict[str, list[StepRow]] = {str(t.adapter): [] for t in _TRAINED}
            async with (
                _running_batcher(gateway, live[ALPHA.name], args, out) as alpha_batcher,
                _running_batcher(gateway, live[BETA.name], args, out) as beta_batcher,
            ):
                say(f"batchers: {alpha_batcher} and {beta_batcher}")
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    for tenant in live.values():
                        tg.start_soon(tenant.traffic.run, stop)
                    async with anyio.create_task_group() as watch:
                        watch.start_soon(gateway.fail_if_exits)
                        try:
                            async with anyio.create_task_group() as training:
                                for t in _TRAINED:
                                    training.start_soon(
                                        _train, live[t.name], gateway, rows[str(t.adapter)], args, started, work
                                    )
                        finally:
                            stop.set()  # users finish the session they are in, then leave
                        watch.cancel_scope.cancel()
            versions = await _wait_applied(gateway, {t: len(rows[str(t.adapter)]) for t in _TRAINED})
            events = await read_policy_events(gateway.nats_url)
            base_version = await _health_policy_version(gateway)
            listed, foreign = await _isolation(gateway)
            live_s = time.monotonic() - started
    return AdapterRun(
        model="tiny",
        targets=targets,
        rank=args.rank,
        rows=rows,
        ratings={name: t.scorer.ratings for name, t in live.items()},
        users={name: t.traffic.statistics() for name, t in live.items()},
        tenants={t.name: t for t in TENANTS},
        events=events,
        served_versions=versions,
        listed_models=listed,
        foreign_requests=foreign,
        base_policy_version=base_version,
        base_drift={str(t.adapter): trainers[t.adapter].base_drift() for t in _TRAINED},
        trainable_parameters=trainers[ALPHA.adapter].trainable_parameters,
        base_parameters=trainers[ALPHA.adapter].base_parameters,
        live_s=live_s,
        started_unix=started_unix,
        logs=(out / "gateway.log", *(out / f"batcher-{t.adapter}.log" for t in _TRAINED)),
    )


def _live_tenants(
    args: argparse.Namespace,
    gateway: GatewayProcess,
    trainers: dict[str | None, LoraGrpoTrainer],
    data_dir: Path,
    started: float,
) -> dict[str, _Tenant]:
    """Each tenant's users (with its key and its reward), its trainer and its batch directory."""
    live: dict[str, _Tenant] = {}
    for index, tenant in enumerate(TENANTS):
        users = args.base_users if tenant is BASE else args.users
        scorer = Scorer(tenant, started=started)
        traffic = UserTraffic(
            base_url=gateway.base_url,
            model="tiny",  # what the client asks for; the key's binding picks the adapter
            users=users,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            seed=args.seed + 1000 * index,
            api_key=tenant.key,
            reward=scorer,
        )
        live[tenant.name] = _Tenant(
            tenant,
            traffic,
            scorer,
            trainers.get(tenant.adapter) if tenant.adapter else None,
            data_dir / f"batches-{tenant.adapter}" if tenant.adapter else None,
        )
    if args.base_users == 0:
        del live[BASE.name]
    return live


@asynccontextmanager
async def _running_batcher(
    gateway: GatewayProcess, tenant: _Tenant, args: argparse.Namespace, out: Path, stop_timeout_s: float = 30.0
) -> AsyncIterator[str]:
    """``stream-gateway batch --adapter NAME`` as a child process until the block exits; its command line."""
    assert tenant.tenant.adapter is not None and tenant.batch_dir is not None
    command = [
        *gateway_command(),
        "batch",
        "--nats-url", gateway.nats_url,
        "--adapter", tenant.tenant.adapter,
        "--batch-size", str(args.batch_size),
        "--group-size", str(args.group_size),
        "--output-dir", str(tenant.batch_dir),
    ]  # fmt: skip
    log_path = out / f"batcher-{tenant.tenant.adapter}.log"
    with log_path.open("wb") as log:
        process = await anyio.open_process(command, stdin=None, stdout=log, stderr=log, start_new_session=True)
        try:
            yield f"`stream-gateway batch --adapter {tenant.tenant.adapter}` (log: {log_path})"
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGINT)
                    with anyio.move_on_after(stop_timeout_s):
                        await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                await process.aclose()


async def _train(
    tenant: _Tenant,
    gateway: GatewayProcess,
    rows: list[StepRow],
    args: argparse.Namespace,
    started: float,
    work: Path,
) -> None:
    """One step per batch of the tenant's adapter, each published as the adapter's version = step."""
    import nats
    from consumers.parquet import decode_batch
    from pipeline.policies import publish_policy

    trainer, adapter, batch_dir = tenant.trainer, tenant.tenant.adapter, tenant.batch_dir
    assert trainer is not None and adapter is not None and batch_dir is not None
    nc = await nats.connect(gateway.nats_url, connect_timeout=5, max_reconnect_attempts=-1)
    try:
        seen: set[Path] = set()
        for step in range(1, args.steps + 1):
            if time.monotonic() - started > args.duration:
                say(f"{adapter}: --duration {args.duration:g} s reached after {step - 1} steps")
                break
            path = await _next_batch(batch_dir, seen, gateway.log_path)
            trajectories, uids = decode_batch(await anyio.Path(path).read_bytes())
            if any(t.adapter != adapter for t in trajectories):  # the batcher's --adapter promise
                raise RuntimeError(f"batch {path.name} of {adapter!r} holds another adapter's trajectories")
            result = await anyio.to_thread.run_sync(trainer.step, trajectories, uids)
            directory = work / "published" / adapter / f"v{step}"
            await anyio.to_thread.run_sync(trainer.save, directory)
            await publish_policy(nc, directory, step, adapter=adapter, weights=f"adapters_rl {adapter} step {step}")
            await anyio.to_thread.run_sync(shutil.rmtree, directory)  # the gateway downloads it from NATS
            elapsed = time.monotonic() - started
            rows.append(StepRow(step=step, policy_version=step, elapsed_s=elapsed, result=result))
            users = tenant.traffic.statistics()
            say(
                f"{adapter:5s} step {step:3d}/{args.steps}  reward {result.mean_reward:.3f}  "
                f"({result.n_trajectories} trajectories sampled by {adapter} v{result.min_policy_version}-"
                f"v{result.max_policy_version})  loss {result.loss:+.4f}  entropy {result.entropy:.2f}  "
                f"-> published {adapter} v{step}  |  {tenant.tenant.name}: {users.turns_served} turns, "
                f"{users.errors} errors  |  {elapsed:.0f} s"
            )
    finally:
        await nc.drain()


async def _next_batch(directory: Path, seen: set[Path], log_path: Path) -> Path:
    """The oldest batch file not trained on yet (the batcher renames whole files into place)."""
    with anyio.move_on_after(_BATCH_TIMEOUT_S):
        while True:
            path = await anyio.to_thread.run_sync(_oldest_unseen, directory, seen)
            if path is not None:
                seen.add(path)
                return path
            await anyio.sleep(0.1)
    raise TimeoutError(f"no new batch in {directory} for {_BATCH_TIMEOUT_S:g} s: see {log_path} and the batcher logs")


def _oldest_unseen(directory: Path, seen: set[Path]) -> Path | None:
    fresh = [p for p in directory.glob("*.parquet") if p not in seen]
    return min(fresh, key=lambda p: p.stat().st_mtime_ns, default=None)


async def _wait_applied(gateway: GatewayProcess, wanted: dict[Tenant, int], timeout_s: float = 30.0) -> dict[str, int]:
    """Wait until each tenant's ``/v1/models`` shows its adapter at the wanted version; the versions shown.

    A bound adapter is listed to its own tenant only (its ``parent`` is the base model), with
    ``policy_version`` its version in service.
    """
    shown: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=5.0) as http:
        with anyio.move_on_after(timeout_s):
            while True:
                for tenant in wanted:
                    headers = {"Authorization": f"Bearer {tenant.key}"}
                    for model in (await http.get("/v1/models", headers=headers)).json()["data"]:
                        if model.get("parent"):
                            shown[model["id"]] = int(model["policy_version"])
                if all(shown.get(str(t.adapter), -1) >= n for t, n in wanted.items()):
                    break
                await anyio.sleep(0.2)
    return shown


async def _isolation(gateway: GatewayProcess) -> tuple[dict[str, list[str]], dict[str, int]]:
    """What ``/v1/models`` lists to each tenant, and the status code when the unbound tenant names an adapter."""
    listed: dict[str, list[str]] = {}
    foreign: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30.0) as http:
        for tenant in TENANTS:
            headers = {"Authorization": f"Bearer {tenant.key}"}
            listed[tenant.name] = [m["id"] for m in (await http.get("/v1/models", headers=headers)).json()["data"]]
        for adapter in (str(t.adapter) for t in _TRAINED):
            request = {"model": adapter, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            response = await http.post(
                "/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {BASE.key}"}
            )
            foreign[adapter] = response.status_code
    return listed, foreign


async def _health_policy_version(gateway: GatewayProcess) -> int:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=5.0) as http:
        return int((await http.get("/health")).json()["policy_version"])


def say(message: str) -> None:
    """A progress line on stderr."""
    print(f"adapters_rl: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
