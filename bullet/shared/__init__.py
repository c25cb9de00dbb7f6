"""What the launcher creates once for an instance and hands to the workers and the frontend: the
weights and the paged KV pool (`model.py`), and the private socket directory with the socket
addresses (`endpoints.py`). It sits below `workers`, `launcher` and `frontend`, so that all three
import it and none of them imports another upwards."""
