"""A second, independent gRPC implementation (Python grpcio) driving proxy-server's
ProxyService the way kube-apiserver does: a new gRPC connection and one Proxy stream
per dial. Stubs are generated at run time by grpcio-tools from the project's own
.proto files. Exits non-zero, naming the step, on any deviation from the protocol.

usage: kas_like_client.py --proto-dir DIR (--uds PATH | --tls HOST:PORT --ca F --cert F --key F)
                          --echo HOST:PORT [--closed HOST:PORT] [--authority VALUE]

--authority is sent as the :authority of every request (grpc.default_authority);
without it gRPC core chooses: for a unix: target the percent-encoded socket path
(as grpc-go's), for TLS the HOST:PORT dialed.
"""

import argparse

import atexit
import os
import queue
import random
import shutil
import sys
import tempfile

import grpc
from grpc_tools import protoc


def load_stubs(proto_dir):
    # Removed when the client exits: the modules are imported by then.
    out = tempfile.mkdtemp(prefix="konn-stubs-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for name in ("client.proto", "agent.proto"):
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}",
                          os.path.join(proto_dir, name)])
        if rc != 0:
            sys.exit(f"protoc failed on {name}")
    sys.path.insert(0, out)
    import client_pb2
    import client_pb2_grpc
    return client_pb2, client_pb2_grpc


def expect(condition, what):
    if not condition:
        sys.exit(f"FAIL: {what}")


class Stream:
    """One Proxy stream on its own channel, fed from a queue."""

    def __init__(self, pb, pb_grpc, args):
        self.pb = pb
        self.requests = queue.Queue()
        options = [] if args.authority is None else [("grpc.default_authority", args.authority)]
        if args.uds:
            self.channel = grpc.insecure_channel(f"unix://{args.uds}", options=options)
        else:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            credentials = grpc.ssl_channel_credentials(read(args.ca), read(args.key), read(args.cert))
            self.channel = grpc.secure_channel(args.tls, credentials, options=options)
        stub = pb_grpc.ProxyServiceStub(self.channel)
        self.responses = stub.Proxy(iter(self.requests.get, None), timeout=20)

    def send(self, packet):
        self.requests.put(packet)

    def recv(self):
        return next(self.responses)

    def close(self):
        self.requests.put(None)
        self.channel.close()


def dial(pb, stream, address):
    dial_id = random.randint(1, 2**62)
    stream.send(pb.Packet(type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address=address, random=dial_id)))
    rsp = stream.recv()
    expect(rsp.type == pb.DIAL_RSP and rsp.WhichOneof("payload") == "dialResponse", f"DIAL_RSP expected, got {rsp}")
    expect(rsp.dialResponse.random == dial_id, "DIAL_RSP echoes the request's random")
    return rsp.dialResponse


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--proto-dir", required=True)
    parser.add_argument("--uds")
    parser.add_argument("--tls")
    parser.add_argument("--ca")
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("--echo", required=True)
    parser.add_argument("--closed")
    parser.add_argument("--authority")
    args = parser.parse_args()
    echo_target = args.echo
    pb, pb_grpc = load_stubs(args.proto_dir)

    # 1. A successful dial, data both ways, and a client close.
    for round_ in range(3):
        stream = Stream(pb, pb_grpc, args)
        rsp = dial(pb, stream, echo_target)
        expect(rsp.error == "", f"dial succeeded (error {rsp.error!r})")
        expect(rsp.connectID > 0, "a positive connectID")
        cid = rsp.connectID
        # The echo target speaks the test protocol: 'E' + 16 bytes of header, then echoes.
        payload = bytes(random.getrandbits(8) for _ in range(4096))
        stream.send(pb.Packet(type=pb.DATA, data=pb.Data(connectID=cid, data=b"E" + bytes(16) + payload)))
        echoed = b""
        while len(echoed) < len(payload):
            pkt = stream.recv()
            expect(pkt.type == pb.DATA and pkt.data.connectID == cid, f"DATA for connectID {cid}, got {pkt}")
            echoed += pkt.data.data
        expect(echoed == payload, "echoed bytes equal the sent bytes")
        stream.send(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=cid)))
        pkt = stream.recv()
        expect(pkt.type == pb.CLOSE_RSP and pkt.closeResponse.connectID == cid, f"CLOSE_RSP for {cid}, got {pkt}")
        expect(pkt.closeResponse.error == "", "a clean CLOSE_RSP")
        stream.close()
        print(f"round {round_}: DIAL_RSP connectID={cid}, {len(payload)} bytes echoed, CLOSE_RSP")

    # 2. DATA naming another connection's id closes this one, with an error.
    stream = Stream(pb, pb_grpc, args)
    rsp = dial(pb, stream, echo_target)
    cid = rsp.connectID
    stream.send(pb.Packet(type=pb.DATA, data=pb.Data(connectID=cid + 1000, data=b"E" + bytes(16))))
    pkt = stream.recv()
    expect(pkt.type == pb.CLOSE_RSP and pkt.closeResponse.connectID == cid, f"CLOSE_RSP for {cid}, got {pkt}")
    expect("connectID" in pkt.closeResponse.error, f"the error names the foreign id, got {pkt.closeResponse.error!r}")
    stream.close()
    print(f"foreign connectID: CLOSE_RSP error {pkt.closeResponse.error!r}")

    # 3. A dial to a closed port: DIAL_RSP carries the agent's error text.
    if args.closed:
        stream = Stream(pb, pb_grpc, args)
        rsp = dial(pb, stream, args.closed)
        expect("connection refused" in rsp.error, f"refused dial names the error, got {rsp.error!r}")
        expect(rsp.connectID == 0, "no connectID on failure")
        stream.close()
        print(f"refused dial: {rsp.error}")
    print("python grpcio client: all protocol checks passed")


if __name__ == "__main__":
    main()
