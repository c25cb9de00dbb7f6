"""The fuzz/soak driver's parts (`python -m artifact.fuzz_soak`): generated HTTP cases, raw payloads
for the server's local sockets, probes of the server's processes and pool, the soak load, and the
report. Nothing here decides what the server should do beyond "answer, do not crash, do not hang,
leak nothing": each finding is reported with an example, never raised."""
