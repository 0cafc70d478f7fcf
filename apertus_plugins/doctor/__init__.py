"""``apertus doctor``: the release compatibility checks of an Apertus 1.5 checkpoint (SPEC.md section 8).

Every check prints pass, warn or fail with one line of evidence::

    apertus doctor CHECKPOINT [--serve URL] [--compare OTHER_CHECKPOINT] [--dataset MANIFEST]... [--json]

- ``tokenizer``: length, the encode pins of the literals and aliases, the thinking delimiters
  (not special, surviving ``skip_special_tokens``), EOS ``</s>``, ``omnimodal_config`` against the
  tokenizer, the config's ids and offsets and the embedding;
- ``template``: the checkpoint's chat template against the package's rendering vectors, one BOS
  after templating and tokenizing, the training variant's empty system block, the injection guard;
- ``checksums`` (``--checksums MANIFEST``): the tokenizer and template files against a checksum manifest
  of the tokenizer repository (``validation/Apertus_1p5.md5``), naming each file that differs;
- ``config``: ``output_vocab_size`` and the LM head, RoPE scaling, the generation stops;
- ``layout``: the image layout of the training data (``--dataset``) against the serving one;
- ``compare`` (``--compare``): tokenizer files, chat templates and RoPE scaling of two stages;
- ``serve`` (``--serve``): text, image and audio requests, a tool call round trip, thinking and
  the reasoning channel, streaming, a degeneration probe.

In Python: ``run_doctor(path, serve=..., compare=...)`` returns a :class:`Report`. No torch is
needed (tensor shapes come from the safetensors headers).
"""

from .checkpoint_files import CheckpointFiles, DoctorError
from .registry import CHECKS, GROUPS, Check, Context
from .report import FAIL, PASS, STATUSES, WARN, Report, Result
from .runner import load_probe_prompts, run_doctor, select_checks

__all__ = ["CHECKS", "GROUPS", "Check", "CheckpointFiles", "Context", "DoctorError", "FAIL", "PASS", "STATUSES",
           "WARN", "Report", "Result", "load_probe_prompts", "run_doctor", "select_checks"]
