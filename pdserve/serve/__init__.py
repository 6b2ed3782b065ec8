"""Node composition: a node for a role with the HTTP API in front (`node.py`), the in-loop
uvicorn server (`http.py`), the local prefill+decode cluster (`launcher.py`) and offline
generation (`offline.py`)."""
