"""The frontend: the launcher process's side that faces clients.

`http/` serves SGLang's native API, the OpenAI API and Prometheus metrics; `client.py` sends
tokenized requests to the prefill worker and merges the outputs that stream back from both workers;
`serving.py` is a running server without HTTP — the launcher, that client, and the supervisor that
fails in-flight requests and restarts the workers when one dies or hangs."""
