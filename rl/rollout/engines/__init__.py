"""Engine processes. ``hf_server`` is the CPU engine; ``launcher`` runs any engine command
(the CPU engine or ``python -m sglang.launch_server``) as a child process of a Ray actor."""
