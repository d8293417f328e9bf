"""Monitoring building blocks the trainer calls: wandb sink, MoE health metrics, MFU, run report.

Modules are imported on demand (``from moetrain.monitor.mfu import ...``) so that importing this
package stays cheap; wandb and matplotlib are only imported where they are used.
"""
