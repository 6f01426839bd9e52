import pickle

import numpy as np
import pytest
import torch

from rollhpc.batch import Batch, TrainingBatch
from rollhpc.config import import_object, import_spec
from rollhpc.controller.worker_group import WorkerGroup
from rollhpc.parallel import ParallelLayout
from rollhpc.protocol.dispatch import (
    Collect,
    Dispatch,
    collect,
    contract_of,
    register,
    remote_methods,
    split_arguments,
    targets,
)
from rollhpc.protocol.spec import WorkerSpec
from rollhpc.protocol.worker import Worker
from rollhpc.workers.diagnostic import DiagnosticWorker


def test_batch_split_sizes_and_concat_restore_order():
    b = Batch({"x": np.arange(7), "t": torch.arange(7)}, meta={"v": 1})
    parts = b.split(3)
    assert [len(p) for p in parts] == [3, 2, 2]
    assert all(p.meta == {"v": 1} for p in parts)
    back = Batch.concat(parts)
    assert back["x"].tolist() == list(range(7)) and back["t"].tolist() == list(range(7))


def test_batch_rejects_ragged_fields_and_mismatched_concat():
    with pytest.raises(ValueError, match="differ in leading size"):
        Batch({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="different fields"):
        Batch.concat([Batch({"a": np.zeros(1)}), Batch({"b": np.zeros(1)})])


def test_split_arguments_cuts_batches_and_lists_and_replicates_the_rest():
    per_rank = split_arguments(
        (Batch({"x": np.arange(4)}), [1, 2, 3], 5), {"scale": 2, "items": ["a", "b"]}, 2
    )
    (a0, k0), (a1, k1) = per_rank
    assert a0[0]["x"].tolist() == [0, 1] and a1[0]["x"].tolist() == [2, 3]
    assert a0[1] == [1, 2] and a1[1] == [3]
    assert a0[2] == a1[2] == 5
    assert k0 == {"scale": 2, "items": ["a"]} and k1 == {"scale": 2, "items": ["b"]}


def test_a_training_batch_is_cut_by_rows_like_a_batch_and_pickles():
    tokens, mask = np.arange(5 * 4).reshape(5, 4), np.ones((5, 3), np.float32)
    batch = TrainingBatch(tokens, mask, np.arange(5.0, dtype=np.float32), gen_logprob=-mask)
    (a0, _), (a1, _) = split_arguments((batch,), {}, 2)
    first, second = a0[0], a1[0]
    assert isinstance(first, TrainingBatch) and [len(first), len(second)] == [3, 2]
    assert first.tokens.tolist() == tokens[:3].tolist() and second.advantage.tolist() == [3.0, 4.0]
    assert first.old_logprob is None and second.gen_logprob.shape == (2, 3)
    assert list(first.as_batch().keys()) == ["tokens", "loss_mask", "advantage", "gen_logprob"]
    back = pickle.loads(pickle.dumps(second, protocol=5))
    assert back.tokens.tolist() == tokens[3:].tolist() and back.ref_logprob is None
    with pytest.raises(ValueError, match="differ in leading size"):
        TrainingBatch(tokens, mask[:4], np.zeros(5, np.float32))


def test_collect_modes_against_a_tp2_pp2_layout():
    layout = ParallelLayout(world=8, tp=2, pp=2)  # dp = 2; leaders: tp rank 0 on the last stage
    coords = layout.all_coords()
    by_rank = {r: [r] for r in range(8)}
    all_contract = contract_of(DiagnosticWorker, "echo")
    assert collect(all_contract, by_rank, coords) == [[r] for r in range(8)]
    dp_contract = contract_of(DiagnosticWorker, "count_items")
    # group ranks of (dp0, pp1, tp0), (dp1, pp1, tp0)
    assert collect(dp_contract, by_rank, coords) == [
        4,
        6,
    ]
    zero = contract_of(DiagnosticWorker, "whoami")
    assert targets(zero, coords) == [0]
    assert collect(zero, {0: "me"}, coords) == "me"


def test_leader_batches_are_concatenated_in_dp_order():
    layout = ParallelLayout(world=4, tp=2)
    res = {
        0: Batch({"x": np.array([0, 1])}),
        1: Batch({"x": np.array([9, 9])}),
        2: Batch({"x": np.array([2])}),
        3: Batch({"x": np.array([9])}),
    }
    out = collect(contract_of(DiagnosticWorker, "tag_rows"), res, layout.all_coords())
    assert out["x"].tolist() == [0, 1, 2]


def test_register_contract_and_typos():
    assert contract_of(DiagnosticWorker, "tag_rows").dispatch is Dispatch.DP_SPLIT
    with pytest.raises(AttributeError, match="no remote method 'tag_row'.*tag_rows"):
        contract_of(DiagnosticWorker, "tag_row")
    with pytest.raises(ValueError, match="rank-zero call"):
        register(Dispatch.RANK_ZERO, Collect.ALL)


class _EchoSpec(WorkerSpec):
    @register(Dispatch.DP_SPLIT)
    def tag(self, batch: Batch) -> Batch:
        """The batch, tagged."""
        raise NotImplementedError


class _SiblingImplementation:
    def tag(self, batch: Batch) -> Batch:
        return batch


def test_a_runtime_inherits_its_specs_contracts_without_redeclaring_them():
    class Echo(_EchoSpec, Worker):
        def tag(self, batch: Batch) -> Batch:
            return batch

    assert contract_of(Echo, "tag") == contract_of(_EchoSpec, "tag")
    assert remote_methods(Echo) == remote_methods(_EchoSpec)
    assert {"tag", "ping", "placement_probe", "collective_bandwidth"} <= set(remote_methods(Echo))


def test_a_runtime_that_changes_a_specs_contract_is_refused_at_class_creation():
    with pytest.raises(TypeError, match="keeps its spec's contract"):

        class Echo(_EchoSpec, Worker):
            @register(Dispatch.ONE_TO_ALL)
            def tag(self, batch: Batch) -> Batch:
                return batch

    with pytest.raises(TypeError, match="hides the implementation _SiblingImplementation.tag"):

        class Shadowed(_EchoSpec, _SiblingImplementation, Worker):
            pass


@pytest.mark.parametrize(
    "path",
    [
        "rollhpc.workers.megatron_policy:MegatronTrainWorker",
        "rollhpc.workers.megatron_policy:MegatronCriticWorker",
        "rollhpc.workers.megatron_policy:MegatronReferenceWorker",
        "rollhpc.workers.vllm_generate:VllmGenerateWorker",
    ],
)
def test_a_worker_group_built_from_the_spec_calls_as_the_runtime_declares(path):
    """The controller builds its groups from the spec (config.import_spec); every remote method the rank's
    runtime class has, with the same contract, and each implemented there (not the spec's declaration)."""
    spec, runtime = import_spec(path, "roles.x.worker"), import_object(path, "roles.x.worker")
    assert spec is not runtime and issubclass(runtime, spec)
    assert remote_methods(spec) == remote_methods(runtime)
    group = WorkerGroup(None, "x", spec, [1, 2], ParallelLayout(world=2))
    for name, contract in remote_methods(runtime).items():
        assert getattr(group, name).contract == contract
        assert name == "collective_bandwidth" or getattr(runtime, name) is not getattr(spec, name)
