"""`pdserve bench`: an OpenAI-API load generator and the arithmetic of its report."""
