"""Launch backends beyond one machine: Ray actors (``ray``) and Slurm batch scripts
(``slurm``). The built-in launcher (``ddiloco.runtime.launch.launcher``) runs on one host."""
