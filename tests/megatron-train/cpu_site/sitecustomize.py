"""Loads the suite's CPU harness (``cpu_patches``) into every process started with it on ``PYTHONPATH``.

Test code. A torchrun worker (``LOCAL_RANK`` set) with ``APERTUS_MEGATRON_CPU=1`` installs the
patches before anything else runs; the torchrun parent and other processes are left alone
(``APERTUS_MEGATRON_CPU_ALL=1`` patches a plain process too). An error installing them ends the
worker with the harness's message. ``APERTUS_TEST_KILL_AFTER_CHECKPOINT=N`` kills the worker
right after it saved iteration N (the resume test's preemption); ``APERTUS_TEST_EXACT_GRAD_NORM=1`` prints each
step's gradient norm to full precision; ``APERTUS_TEST_XIELU=composed`` runs the composed xIELU formula (the
training benchmark's "before"); ``APERTUS_TEST_STEP_CPU_TIME=1`` prints each step's CPU time.
"""

import os
import sys

if os.environ.get("APERTUS_MEGATRON_CPU") == "1" and ("LOCAL_RANK" in os.environ
                                                      or os.environ.get("APERTUS_MEGATRON_CPU_ALL") == "1"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cpu_patches

    cpu_patches.install()
    if os.environ.get("APERTUS_TEST_KILL_AFTER_CHECKPOINT"):
        cpu_patches.kill_after_checkpoint(int(os.environ["APERTUS_TEST_KILL_AFTER_CHECKPOINT"]))
    if os.environ.get("APERTUS_TEST_EXACT_GRAD_NORM") == "1":
        cpu_patches.print_exact_grad_norm()
    if os.environ.get("APERTUS_TEST_XIELU") == "composed":
        cpu_patches.use_composed_xielu()
    if os.environ.get("APERTUS_TEST_STEP_CPU_TIME") == "1":
        cpu_patches.print_step_cpu_time()
    del sys.path[0]
