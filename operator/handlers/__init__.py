"""kopf handlers: the only operator code that talks to the API server."""
