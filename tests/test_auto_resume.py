"""Periodic checkpoints and automatic resume (zero/checkpoint/periodic.py): saves every N steps keep
the newest K; a restarted job resumes from the newest complete one, skipping a torn one, with the
data loader's position, and ends with the parameters of an unbroken run, bit for bit."""
import logging

import pytest
import torch

STEPS, INTERVAL, KEEP = 7, 2, 2


def _config(directory: str, stage: int, resume: bool, node_local: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu"}} if stage == 3 else {})},
            "checkpoint": {"dir": directory, "save_interval": INTERVAL, "keep_last": KEEP, "auto_resume": resume,
                           "use_node_local_storage": node_local}}


def _train(directory: str, stage: int, resume: bool, until: int, node_local: bool = False
           ) -> tuple[int, list[torch.Tensor]]:
    """A GPT on a token dataset through initialize's loader until `until` optimizer steps; returns
    (the step it started from, the final parameters in full)."""
    import zero
    from zero.models import GPT, GPTConfig

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (64, 9), generator=torch.Generator().manual_seed(1)))
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    engine, _, loader, _ = zero.initialize(model=model, training_data=data,
                                           config=_config(directory, stage, resume, node_local))
    start = engine.global_steps
    while engine.global_steps < until:
        for (batch,) in loader:
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
            if engine.global_steps == until:
                break
    state = engine.consolidated_16bit_state_dict() or {}
    return start, [t.float().clone() for _, t in sorted(state.items())]


def _resume_after_a_torn_save(directory: str, stage: int):
    import torch.distributed as dist

    from zero.checkpoint.periodic import newest_complete

    _, unbroken = _train(directory + "/unbroken", stage, resume=False, until=STEPS)
    tags = sorted(p.name for p in __import__("pathlib").Path(directory + "/unbroken").glob("global_step*"))
    # a job that saved at steps 2, 4, 6 and died while writing its save at step 6: that tag is torn
    _train(directory + "/broken", stage, resume=False, until=6)
    dist.barrier()
    if dist.get_rank() == 0:
        torn = sorted((__import__("pathlib").Path(directory) / "broken" / "global_step6").rglob("*.safetensors"))[0]
        torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    dist.barrier()
    found, skipped = newest_complete(directory + "/broken")
    unmarked = None
    if dist.get_rank() == 0:  # the same tags, step 6's without its state file (the commit marker)
        import shutil

        shutil.copytree(directory + "/broken", directory + "/unmarked")
        (__import__("pathlib").Path(directory) / "unmarked" / "global_step6" / "zero_checkpoint.json").unlink()
        unmarked = newest_complete(directory + "/unmarked")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zero").addHandler(handler)
    try:
        start, resumed = _train(directory + "/broken", stage, resume=True, until=STEPS)
    finally:
        logging.getLogger("zero").removeHandler(handler)
    messages = [r.getMessage() for r in records]
    same = all(torch.equal(a, b) for a, b in zip(unbroken, resumed)) and len(unbroken) == len(resumed)
    return tags, found.name, skipped, start, same, messages, unmarked


@pytest.mark.parametrize("stage", [1, 3])
def test_a_restarted_job_resumes_from_the_newest_complete_checkpoint_and_ends_as_an_unbroken_one(dist_run, tmp_path,
                                                                                                 stage):
    for rank, (tags, found, skipped, start, same, messages, unmarked) in enumerate(
            dist_run(2, _resume_after_a_torn_save, str(tmp_path), stage)):
        assert tags == ["global_step4", "global_step6"], tags  # keep_last 2 of the saves at 2, 4, 6
        assert found == "global_step4" and "global_step6" in skipped[0] and "contents changed" in skipped[0], skipped
        assert start == 4  # resumed at the newest complete step
        assert same  # bit for bit the unbroken run's parameters
        if rank == 0:
            assert any("skips global_step6" in m for m in messages), messages
            path, why = unmarked
            assert path.name == "global_step4" and "zero_checkpoint.json is missing" in why[0], unmarked
            assert any("resumed from" in m and "global_step4" in m for m in messages), messages


def _two_nodes(directory: str, stage: int):
    """Four ranks as two "nodes" of two (GROUP_RANK, as torchrun sets it), each saving to a
    directory of its own: save and resume; the nodes' directories copied into one; one node's file
    lost; that node's whole directory lost."""
    import os
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from zero.checkpoint.training import CheckpointError

    rank = dist.get_rank()
    mine = f"{directory}/node{rank // 2}"

    def everyone_then(step) -> None:
        dist.barrier()
        step()
        dist.barrier()

    def caught(fn) -> str | None:
        try:
            fn()
        except CheckpointError as exc:
            return str(exc)
        return None

    _, unbroken = _train(directory + "/unbroken", stage, resume=False, until=STEPS)
    os.environ["GROUP_RANK"] = str(rank // 2)
    try:
        _train(mine, stage, resume=False, until=6, node_local=True)  # saves at 2, 4, 6; keeps 4 and 6
        files = sorted(str(p.relative_to(mine)) for p in Path(mine).rglob("*.safetensors"))
        start, resumed = _train(mine, stage, resume=True, until=STEPS, node_local=True)
        os.environ.pop("GROUP_RANK")
        everyone_then(lambda: rank == 0 and [shutil.copytree(f"{directory}/node{n}/global_step6",
                                                             f"{directory}/shared/global_step6", dirs_exist_ok=True)
                                             for n in (0, 1)])
        shared_start, from_shared = _train(directory + "/shared", stage, resume=True, until=STEPS)
        os.environ["GROUP_RANK"] = str(rank // 2)
        # node 1 loses the tensor file of one of its ranks: loading that tag fails on every rank,
        # naming the node and the file; auto_resume takes the tag before it
        everyone_then(lambda: rank == 2 and next(Path(mine, "global_step6", "tensors").glob("*.safetensors")).unlink())
        import zero
        from zero.models import GPT, GPTConfig

        engine, *_ = zero.initialize(model=GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)),
                                     config=_config(mine, stage, False, True))
        torn = caught(lambda: engine.load_checkpoint(mine, tag="global_step6"))
        fallback = _train(mine, stage, resume=True, until=5, node_local=True)[0]
        everyone_then(lambda: rank == 2 and shutil.rmtree(mine))  # node 1 loses everything
        gone = caught(lambda: _train(mine, stage, resume=True, until=STEPS, node_local=True))
    finally:
        os.environ.pop("GROUP_RANK", None)
    same = [len(unbroken) == len(r) and all(torch.equal(a, b) for a, b in zip(unbroken, r))
            for r in (resumed, from_shared)]
    return files, (start, shared_start, fallback), same, (torn, gone)


@pytest.mark.parametrize("stage", [1, 3])
def test_node_local_storage_saves_each_nodes_files_on_its_node_and_refuses_a_node_without_them(dist_run, tmp_path,
                                                                                                stage):
    for rank, (files, starts, same, (torn, gone)) in enumerate(dist_run(4, _two_nodes, str(tmp_path), stage)):
        ranks = (0, 1) if rank < 2 else (2, 3)
        assert [f for f in files if f.startswith("global_step6/rng/")] == \
            [f"global_step6/rng/rank{r}.safetensors" for r in ranks], files  # each node holds its own ranks' files
        assert starts == (6, 6, 4) and same == [True, True], (starts, same)
        assert torn is not None and "/node1 (ranks 2, 3)" in torn and "missing: tensors/" in torn, torn
        assert gone is not None and "no checkpoint" in gone and "/node1 (ranks 2, 3) holds none" in gone, gone


def test_the_periodic_keys_need_a_directory():
    from zero.config import ConfigError, load_config

    for keys in ({"save_interval": 2}, {"auto_resume": True, "keep_last": 2}):
        with pytest.raises(ConfigError) as info:
            load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": keys}, 1)
        assert dict(info.value.issues) == {f"checkpoint.{k}": "needs checkpoint.dir (the directory to save to and "
                                           "resume from)" for k in keys}
    with pytest.raises(ConfigError, match="save_interval"):
        load_config({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"dir": "/tmp", "save_interval": 0}}, 1)


def _env() -> dict:
    import os

    # torch's shared rendezvous store keeps a dead attempt's addresses (pytorch/pytorch#135712)
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}


def _torchrun(tmp, name: str, *args: str, restarts: int = 0, nproc: int = 2) -> tuple[str, dict]:
    import subprocess
    import sys

    from safetensors.torch import load_file

    out = tmp / f"{name}.safetensors"
    env = _env()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                          "--max-restarts", str(restarts), "-m", "zero.testing.resume_job", "--dir", str(tmp / name),
                          "--out", str(out), *args], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr, load_file(out)


def _killed_run_matches(tmp, unbroken: dict, args: list[str], kill_at: int, kill_rank: int, resumed_at) -> None:
    name = f"killed-{kill_rank}-{kill_at}-{'-'.join(args)}"
    log, killed = _torchrun(tmp, name, *args, "--kill-at", str(kill_at), "--kill-rank", str(kill_rank), restarts=2)
    assert "exitcode: -9" in log  # the rank really died
    assert any(f"resumed from {tmp / name}/global_step{n} (global step {n})" in log
               and f"attempt 1 starts at step {n}" in log for n in resumed_at), log[-2000:]
    assert unbroken.keys() == killed.keys() and all(torch.equal(unbroken[k], killed[k]) for k in unbroken), \
        f"killed rank {kill_rank} at step {kill_at}: the parameters differ from the unbroken run's"


@pytest.mark.parametrize("stage,offload", [(1, False), (3, True)])
def test_a_rank_killed_at_a_random_step_under_torchrun_restarts_and_ends_as_an_unbroken_run(tmp_path, stage, offload):
    """Kill -9 one rank (chosen at random, as is the step, for each seed) under torchrun
    --max-restarts 2: the job finishes by itself, resumed from the newest checkpoint before the kill
    (saves every 2 steps), with the unbroken run's parameters bit for bit."""
    import random

    args = ["--steps", "9", "--stage", str(stage), *(["--offload"] if offload else [])]
    _, unbroken = _torchrun(tmp_path, "unbroken", *args)
    for seed in (stage, stage + 10):
        draw = random.Random(seed)
        kill_at, kill_rank = draw.randint(2, 8), draw.randint(0, 1)
        _killed_run_matches(tmp_path, unbroken, args, kill_at, kill_rank, (kill_at - kill_at % INTERVAL,))


@pytest.mark.parametrize("optimizer,stage,offload",
                         [("SGD", 1, False), ("Lion", 2, False), ("Adagrad", 3, False), ("RMSprop", 3, True)])
def test_a_killed_rank_auto_resumes_other_optimizers_as_the_unbroken_run(tmp_path, optimizer, stage, offload):
    """The config's SGD, Lion and Adagrad and a client torch optimizer (RMSprop, stepping on host
    masters) keep their state in zero's storage, so periodic saves hold it: a rank killed under torchrun --max-restarts
    resumes and ends as the unbroken run, bit for bit."""
    args = ["--steps", "7", "--stage", str(stage), "--optimizer", optimizer, *(["--offload"] if offload else [])]
    _, unbroken = _torchrun(tmp_path, "unbroken", *args)
    _killed_run_matches(tmp_path, unbroken, args, 5, 1, (4,))


@pytest.mark.parametrize("stage,offload", [(1, False), (3, True)])
def test_a_rank_killed_while_a_background_save_is_written_resumes_from_the_one_before(tmp_path, stage, offload):
    """Rank 1 dies inside the background write of step 6's save, after its tensor file and before
    the tag is published: the torn save is never loaded, the job resumes from step 4 and ends as an
    unbroken run."""
    args = ["--steps", "9", "--stage", str(stage), "--async-save", *(["--offload"] if offload else [])]
    _, unbroken = _torchrun(tmp_path, "unbroken", *args)
    log, killed = _torchrun(tmp_path, "killed", *args, "--kill-in-save", "6", restarts=2)
    assert "killed while writing" in log and ".global_step6.tmp" in log and "exitcode: -9" in log, log[-3000:]
    assert f"resumed from {tmp_path / 'killed'}/global_step4 (global step 4)" in log, log[-3000:]
    assert unbroken.keys() == killed.keys() and all(torch.equal(unbroken[k], killed[k]) for k in unbroken)


def _two_agents(tmp, name: str, *args: str) -> tuple[list[str], list[int], float]:
    """Two torchrun agents on this host as two nodes of two ranks (static rendezvous on localhost),
    each keeping its checkpoints in a directory of its own (`{node}`); their outputs, exit codes
    and the seconds they took."""
    import socket
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env(), "ZERO_COLLECTIVE_TIMEOUT": "60"}
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
                                "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                                "-m", "zero.testing.resume_job", "--dir", str(tmp / name / "node{node}"), "--node-local",
                                "--out", str(tmp / f"{name}.safetensors"), *args],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    began = time.time()
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    return outputs, [a.returncode for a in agents], time.time() - began


def test_two_nodes_with_node_local_storage_save_resume_and_refuse_a_node_without_its_files(tmp_path):
    import shutil

    from safetensors.torch import load_file

    _, unbroken = _torchrun(tmp_path, "unbroken", "--steps", "9", nproc=4)
    outputs, codes, _ = _two_agents(tmp_path, "nodes", "--steps", "6")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    for rank in range(4):  # what each rank was given and what zero reads from it
        node, local = rank // 2, rank % 2
        assert (f"resume_job: rank {rank} node {node} LOCAL_RANK {local} LOCAL_WORLD_SIZE 2 engine.local_rank {local} "
                f"comm.get_local_rank {local} world 4 devices 2 nodes [[0, 1], [2, 3]]") in outputs[node], \
            outputs[node][-2000:]
    for node in (0, 1):  # each node's disk holds its own ranks' files
        ranks = sorted(p.name for p in (tmp_path / "nodes" / f"node{node}" / "global_step6" / "rng").iterdir())
        assert ranks == [f"rank{r}.safetensors" for r in (2 * node, 2 * node + 1)], ranks
    outputs, codes, _ = _two_agents(tmp_path, "nodes", "--steps", "9")
    assert codes == [0, 0] and "attempt 0 starts at step 6" in outputs[0], outputs[0][-3000:]
    resumed = load_file(tmp_path / "nodes.safetensors")
    assert unbroken.keys() == resumed.keys() and all(torch.equal(unbroken[k], resumed[k]) for k in unbroken)
    shutil.rmtree(tmp_path / "nodes" / "node1")  # node 1's disk lost its checkpoints
    outputs, codes, took = _two_agents(tmp_path, "nodes", "--steps", "12")
    assert codes[0] != 0 and codes[1] != 0 and took < 120, (codes, took)
    for output in outputs:  # every rank, on both nodes, says why
        assert output.count("/node1 (ranks 2, 3) holds none") >= 2, output[-3000:]


ELASTIC = {"enabled": True, "max_train_batch_size": 12, "micro_batch_sizes": [1, 2], "version": 0.1}


def _elastic_leg(directory: str, until: int):
    """A GPT trained with the elastic section (batch 12 for 1, 2, 3, 4, 6 or 12 ranks) and a save
    every 3 steps, resuming from `directory` if it holds one; (the step it started at, the final
    parameters, the micro-batch and accumulation it chose, the log line saying so)."""
    import zero
    from zero.models import GPT, GPTConfig

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("zero").addHandler(handler)
    try:
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randint(0, 64, (96, 9), generator=torch.Generator().manual_seed(1)))
        engine, _, loader, _ = zero.initialize(
            model=GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)), training_data=data,
            config={"elasticity": ELASTIC, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                    "zero_optimization": {"stage": 2},
                    "checkpoint": {"dir": directory, "save_interval": 3, "auto_resume": True}})
    finally:
        logging.getLogger("zero").removeHandler(handler)
    start = engine.global_steps
    while engine.global_steps < until:
        for (batch,) in loader:
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
            if engine.global_steps == until:  # just after the step that ends a window
                break
    state = engine.consolidated_16bit_state_dict() or {}
    said = [r.getMessage() for r in records if "elasticity" in r.getMessage()]
    return (start, [t.float().clone() for _, t in sorted(state.items())],
            (engine.config.train_micro_batch_size_per_gpu, engine.config.gradient_accumulation_steps), said)


def test_an_elastic_job_restarted_on_fewer_or_more_ranks_keeps_its_batch_and_its_course(dist_run, tmp_path):
    """4 ranks restarted on 2, and 2 on 3: the global batch stays 12 (micro-batch and accumulation
    chosen for each size, and logged), the loader resumes at the same sample, and the run ends
    within 1e-6 of the unbroken one (each step sums the same samples, grouped otherwise)."""
    from zero.config import ConfigError, load_config

    unbroken = {}
    for ranks, plan in ((4, (1, 3)), (2, (2, 3))):  # the runs that will be interrupted, unbroken
        _, unbroken[ranks], chosen, said = dist_run(ranks, _elastic_leg, str(tmp_path / f"unbroken{ranks}"), 6)[0]
        assert chosen == plan and f"micro-batch {plan[0]} x accumulation {plan[1]} x {ranks} data" in said[0], said
    for before, after, chosen in ((4, 2, (2, 3)), (2, 3, (2, 2))):
        reference, directory = unbroken[before], str(tmp_path / f"{before}to{after}")
        dist_run(before, _elastic_leg, directory, 3)
        start, params, plan, said = dist_run(after, _elastic_leg, directory, 6)[0]
        assert start == 3 and plan == chosen, (start, plan)
        assert said and f"train_batch_size 12 = micro-batch {chosen[0]} x accumulation {chosen[1]} x {after}" in said[0]
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(params, reference))
        assert len(params) == len(reference) and worst < 1e-6, f"{before} -> {after} ranks: {worst:.2e}"
    with pytest.raises(ConfigError, match=r"5 ranks cannot keep the elastic train_batch_size 12 .*the world sizes "
                                          r"that can: \[1, 2, 3, 4, 6, 12\]"):
        load_config({"elasticity": ELASTIC}, 5)


def test_torchrun_with_one_to_two_nodes_loses_a_node_and_goes_on_with_the_same_global_batch(tmp_path):
    """`torchrun --nnodes 1:2` (c10d rendezvous on localhost), two agents of two ranks, the batch
    from the elasticity section: node 1 dies (its agent and ranks, SIGKILL) after step 3; node 0's
    agent restarts its ranks as a world of 2, which resume from step 2's checkpoint with micro-batch
    2 x accumulation 3 instead of 1 x 3 on 4 ranks, and end within 1e-6 of the unbroken 4-rank run."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    _, unbroken = _torchrun(tmp_path, "unbroken", "--steps", "8", "--elastic", nproc=4)
    # the rendezvous store lives here, in neither agent, so that either may die (as with an etcd store)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-id", "elastic",
         "--rdzv-conf", "last_call_timeout=1,is_host=0", "--max-restarts", "2", "--monitor-interval", "0.5",
         "-m", "zero.testing.resume_job", "--dir", str(tmp_path / "elastic"), "--out",
         str(tmp_path / "elastic.safetensors"), "--steps", "8", "--elastic", "--kill-node-at", "3"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=240)[0] for a in agents]
    del store
    lost = next(k for k in (0, 1) if "node 1 dies after step 3" in outputs[k])  # whichever became node 1
    survivor = outputs[1 - lost]
    assert agents[1 - lost].returncode == 0, survivor[-3000:] + outputs[lost][-2000:]
    assert "micro-batch 2 x accumulation 3 x 2 data-parallel rank(s)" in survivor, survivor[-3000:]
    assert f"resumed from {tmp_path / 'elastic'}/global_step2 (global step 2)" in survivor, survivor[-3000:]
    resumed = load_file(tmp_path / "elastic.safetensors")
    worst = max(((unbroken[k] - resumed[k]).abs().max() / unbroken[k].abs().max()).item() for k in unbroken)
    assert unbroken.keys() == resumed.keys() and worst < 1e-6, worst
