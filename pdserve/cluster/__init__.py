"""`pdserve cluster`: prefill and decode nodes as Ray actors (placed, watched and restarted by
Ray) behind `pdserve router` (`actors.py` the node actor, `run.py` the driver)."""
