"""Small helpers every part may use: importing ``module:name`` (``imports``), where built things are
cached (``cache``), handing the cores from one torch thread to another (``openmp``), a stand-in CUDA
device that checks GPU code on the CPU (``fake_cuda``), and one writer per run folder (``run_folder``).
They import nothing of turnrl but ``types``."""
