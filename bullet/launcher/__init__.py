"""Starting and stopping a server instance: the serving device, decided once (`device_choice.py`),
and the launcher (`launcher.py`), which puts the model and the KV pool in shared memory, creates the
state buffer, the page allocator and the private socket directory, starts the prefill and decode
worker processes, restarts or stops them, and removes every segment however the server ends."""
