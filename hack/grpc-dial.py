"""Fetches a page through proxy-server's gRPC frontend on its Unix socket with
Python's grpcio (gRPC core), whose default :authority for a unix: target is the
percent-encoded socket path, the same as grpc-go's (and so kube-apiserver's).
Packets are encoded by hand (konnectivity's client.proto), so only grpcio is needed.

usage: grpc-dial.py SOCKET HOST:PORT PATH
"""

import queue
import random
import sys

import grpc

DIAL_REQ, DIAL_RSP, CLOSE_REQ, CLOSE_RSP, DATA = 0, 1, 2, 3, 4


def varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number, value):
    """A varint (int) or length-delimited (bytes) field."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def packet(kind, payload_field, payload):
    return field(1, kind) + field(payload_field, payload)


def parse(data):
    """{field number: value} of one message (last value wins)."""
    fields, at = {}, 0
    while at < len(data):
        key, at = read_varint(data, at)
        if key & 7 == 0:
            fields[key >> 3], at = read_varint(data, at)
        else:
            length, at = read_varint(data, at)
            fields[key >> 3], at = data[at:at + length], at + length
    return fields


def read_varint(data, at):
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def main():
    socket_path, target, path = sys.argv[1:4]
    channel = grpc.insecure_channel(f"unix:{socket_path}")
    proxy = channel.stream_stream("/ProxyService/Proxy")
    requests = queue.Queue()
    responses = proxy(iter(requests.get, None), timeout=20)

    dial_id = random.randint(1, 2**62)
    requests.put(packet(DIAL_REQ, 2, field(1, b"tcp") + field(2, target.encode()) + field(3, dial_id)))
    reply = parse(next(responses))
    answer = parse(reply.get(3, b""))
    if reply.get(1, 0) != DIAL_RSP or answer.get(3) != dial_id or answer.get(1):
        sys.exit(f"dial failed: {answer.get(1, b'no DIAL_RSP').decode()}")
    connect_id = answer[2]
    print(f"DIAL_RSP: connectID {connect_id} (authority: gRPC core's default for unix:{socket_path})")

    request = f"GET {path} HTTP/1.0\r\nHost: {target}\r\n\r\n".encode()
    requests.put(packet(DATA, 4, field(1, connect_id) + field(3, request)))
    body = b""
    for message in responses:
        reply = parse(message)
        if reply.get(1, 0) != DATA:
            break  # CLOSE_RSP: the web server closed the connection
        body += parse(reply[4]).get(3, b"")
    requests.put(None)
    channel.close()
    print(body.decode(errors="replace").split("\r\n\r\n", 1)[-1].strip())


if __name__ == "__main__":
    main()
