"""The server: the aiohttp app, typed state, one handler for every managed wire, relays, admin, metrics."""
