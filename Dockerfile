# CPU image that runs the embedded default and the tests. For GPUs, start from an image
# with a CUDA build of torch (e.g. pytorch/pytorch) and install the other requirements.
FROM python:3.11-slim
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt
COPY . .
CMD ["bash", "train.sh"]
