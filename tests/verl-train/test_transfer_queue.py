"""The trainers' TransferQueue reads and writes against a real TransferQueue (local Ray, SimpleStorage).

Two of the bugs the real trainer runs found live here, in how verl's TransferQueue bridge and
tensordict hand fields back:

* the metadata ``kv_batch_put`` returns lists the fields written by that call, and verl's bridge gives a
  worker only those: an offline DPO batch carried on with it never showed the actor the reference
  log-probs written later (``KeyError: 'ref_log_prob'``); :func:`verl_ext.trainers.rows_meta` names the
  rows only;
* a string field (``uid``) comes back as tensordict's ``LinkedList``, a list without ``tolist``
  (``AttributeError`` in online DPO); :func:`verl_ext.trainers.field_list` reads it.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def transfer_queue(tmp_path_factory):
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")),
             log_to_driver=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    try:
        yield tq
    finally:
        tq.close()
        ray.shutdown()


def test_offline_rows_keep_fields_written_after_them(transfer_queue, tiny_checkpoint):
    from verl.utils.transferqueue_utils import kv_batch_meta2batch_meta

    from apertus_plugins.core.chat import ChatTokenizer
    from verl_ext import dpo
    from verl_ext.trainers import rows_meta, tq_fields

    tq = transfer_queue
    chat = ChatTokenizer(tiny_checkpoint)
    records = [{"prompt": [{"role": "user", "content": f"Question {k}"}], "chosen": "Yes.", "rejected": "No " * (k + 1)}
               for k in range(2)]
    fields, tags, keys = dpo.offline_step_rows(dpo.encode_pairs(records, chat, 512, 64), dp_size=1, step=1)
    put_meta = tq.kv_batch_put(keys=keys, partition_id="train", fields=fields, tags=tags)
    # the reference pass writes its log-probs later, as verl's _compute_ref_log_prob does
    ref = torch.nested.as_nested_tensor([torch.full((t["response_len"],), -1.0) for t in tags], layout=torch.jagged)
    tq.kv_batch_put(keys=keys, partition_id="train", fields=tq_fields({"ref_log_prob": ref}, len(keys)))
    # what a worker sees through verl's bridge: with put's metadata the later field is missing ...
    assert "ref_log_prob" not in kv_batch_meta2batch_meta(put_meta).field_names
    # ... with metadata that names the rows only, every field of the rows is there
    seen = kv_batch_meta2batch_meta(rows_meta(keys, tags)).field_names
    assert {"ref_log_prob", "prompts", "responses", "pair_id", "response_mask"} <= set(seen)
    tq.kv_clear(keys=keys, partition_id="train")


def test_string_fields_come_back_as_a_list(transfer_queue):
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from verl_ext.trainers import field_list

    tq = transfer_queue
    uids = ["u0", "u0", "u1", "u1"]
    rows = [{"uid": u, "responses": torch.tensor([i, i + 1])} for i, u in enumerate(uids)]
    keys = [f"{u}_{i}_0" for i, u in enumerate(uids)]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(rows),
                    tags=[{"status": "success"}] * 4)
    got = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["uid"])["uid"]
    assert not hasattr(got, "tolist")  # what the online DPO trainer called
    assert field_list(got) == uids
    assert field_list(torch.tensor([1, 2])) == [1, 2]
    tq.kv_clear(keys=keys, partition_id="train")
