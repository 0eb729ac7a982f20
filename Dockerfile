# CPU image that runs the embedded default and the tests: torch's CPU build (requirements-cpu.txt),
# no CUDA packages. For GPUs, start from an image with a CUDA build of torch (e.g. pytorch/pytorch)
# and install the rest with requirements-gpu.txt, which leaves that torch alone.
FROM python:3.11-slim
WORKDIR /app
COPY requirements.txt requirements-cpu.txt requirements-gpu.txt ./
RUN pip install --no-cache-dir -r requirements-cpu.txt
COPY . .
CMD ["bash", "train.sh"]
