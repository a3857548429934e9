"""The ways in: the CLI (cli), the OpenAI-compatible HTTP server (serve), the C interface (capi), the
offline bundle's launcher (launch) and the device measurement behind `colibri probe-device`."""
