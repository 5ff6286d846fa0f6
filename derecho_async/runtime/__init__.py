"""The asyncio runtime: the driver that runs the pure core over a transport, and the handler
runner that executes replicated actors' calls in order."""
