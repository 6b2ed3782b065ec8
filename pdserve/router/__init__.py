"""`pdserve router`: an OpenAI-compatible front that routes each request to a decode entrance
and a prefill node (policies in `policy.py`, the proxy in `app.py`, the process in `run.py`)."""
