#!/bin/sh
# Rebuild the nvcc binaries of saxpy.cu.  They are committed, so that the tests need no
# nvcc: this is how they were made (nvcc 13.0.88 from the pip wheels nvidia-cuda-nvcc and
# nvidia-nvvm 13.0, with the CUDA runtime headers of nvidia-cuda-runtime/-crt):
#   pip install --target /tmp/nvcc 'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*'
#   PATH=/tmp/nvcc/nvidia/cu13/bin:$PATH CUDA_INCLUDE=.../site-packages/nvidia/cu13/include sh build.sh
set -e
cd "$(dirname "$0")"
INC=${CUDA_INCLUDE:+-I$CUDA_INCLUDE}
nvcc -cubin -arch=sm_90 $INC saxpy.cu -o saxpy.sm_90.cubin
nvcc -fatbin -gencode arch=compute_90,code=[sm_90,compute_90] $INC saxpy.cu -o saxpy.fatbin
nvcc -ptx -arch=compute_90 $INC saxpy.cu -o saxpy.ptx
