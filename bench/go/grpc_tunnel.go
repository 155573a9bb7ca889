//go:build grpc

// The gRPC route of the benchmark's Go client, built with `-tags grpc`
// against Debian's grpc-go (GOPATH mode, nothing downloaded): a tunnel
// dialed the way kube-apiserver's egress dials it through
// konnectivity-client v0.36.0's CreateSingleUseGrpcTunnelWithContext. Each
// connection is a new grpc.ClientConn on the Unix socket (the socket path
// as the target, a context dialer, insecure credentials, WithBlock), one
// Proxy stream, DIAL_REQ and DIAL_RSP; then each Write is one DATA packet,
// Read returns DATA payloads, and Close sends CLOSE_REQ and closes the
// ClientConn. Packets are encoded with protowire: no generated code.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
)

var grpcUDS = flag.String("grpc-uds", "", "the server's gRPC Unix socket: tunnel each connection through it")

// Packet types and field numbers of konnectivity's client.proto.
const (
	dialReq  = 0
	dialRsp  = 1
	closeReq = 2
	closeRsp = 3
	dataPkt  = 4
)

type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return v.([]byte), nil }
func (rawCodec) Unmarshal(b []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), b...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func packetWith(kind uint64, field protowire.Number, body []byte) []byte {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, kind)
	b = protowire.AppendTag(b, field, protowire.BytesType)
	return protowire.AppendBytes(b, body)
}

// received is what this client reads of a Packet.
type received struct {
	kind      uint64
	errorText string
	connectID int64
	random    int64
	payload   []byte
}

func parsePacket(b []byte) (received, error) {
	var p received
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return p, protowire.ParseError(n)
		}
		b = b[n:]
		if num == 1 && typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return p, protowire.ParseError(n)
			}
			p.kind, b = v, b[n:]
			continue
		}
		if typ != protowire.BytesType {
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return p, protowire.ParseError(n)
			}
			b = b[n:]
			continue
		}
		inner, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return p, protowire.ParseError(n)
		}
		b = b[n:]
		if err := p.payloadFields(num, inner); err != nil {
			return p, err
		}
	}
	return p, nil
}

func (p *received) payloadFields(payload protowire.Number, b []byte) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		if typ == protowire.VarintType {
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return protowire.ParseError(n)
			}
			b = b[n:]
			switch {
			case payload == 3 && num == 2, payload == 4 && num == 1:
				p.connectID = int64(v)
			case (payload == 2 || payload == 3) && num == 3: // DIAL_REQ's and DIAL_RSP's random
				p.random = int64(v)
			}
			continue
		}
		v, n := protowire.ConsumeBytes(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == 1 && payload == 3:
			p.errorText = string(v)
		case payload == 4 && num == 3:
			p.payload = v
		}
	}
	return nil
}

// tunnel is one tunneled connection on a ClientConn of its own.
type tunnel struct {
	net.Conn  // only for the methods the measurements do not use
	cc        *grpc.ClientConn
	stream    grpc.ClientStream
	connectID int64
	pending   []byte
	sendMu    sync.Mutex
}

func init() {
	dialGRPC = func() (net.Conn, error) {
		if *grpcUDS == "" {
			return nil, nil
		}
		t, err := openTunnel(*grpcUDS, *target)
		if err != nil {
			return nil, err
		}
		return t, nil
	}
}

func openTunnel(socket, address string) (*tunnel, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc, err := grpc.DialContext(ctx, socket,
		grpc.WithInsecure(), grpc.WithBlock(), grpc.WithReturnConnectionError(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", addr)
		}))
	if err != nil {
		return nil, fmt.Errorf("grpc dial %s: %v", socket, err)
	}
	stream, err := cc.NewStream(context.Background(), &grpc.StreamDesc{ServerStreams: true, ClientStreams: true},
		"/ProxyService/Proxy", grpc.ForceCodec(rawCodec{}))
	if err != nil {
		cc.Close()
		return nil, fmt.Errorf("Proxy stream: %v", err)
	}
	random := rand.Int63()
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.BytesType)
	body = protowire.AppendString(body, "tcp")
	body = protowire.AppendTag(body, 2, protowire.BytesType)
	body = protowire.AppendString(body, address)
	body = protowire.AppendTag(body, 3, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(random))
	if err := stream.SendMsg(packetWith(dialReq, 2, body)); err != nil {
		cc.Close()
		return nil, fmt.Errorf("DIAL_REQ: %v", err)
	}
	var answer []byte
	if err := stream.RecvMsg(&answer); err != nil {
		cc.Close()
		return nil, fmt.Errorf("DIAL_RSP: %v", err)
	}
	rsp, err := parsePacket(answer)
	if err != nil || rsp.kind != dialRsp || rsp.random != random || rsp.errorText != "" {
		cc.Close()
		return nil, fmt.Errorf("dial %s failed: %+v %v", address, rsp, err)
	}
	return &tunnel{cc: cc, stream: stream, connectID: rsp.connectID}, nil
}

func (t *tunnel) Write(b []byte) (int, error) {
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(t.connectID))
	body = protowire.AppendTag(body, 3, protowire.BytesType)
	body = protowire.AppendBytes(body, b)
	t.sendMu.Lock()
	defer t.sendMu.Unlock()
	if err := t.stream.SendMsg(packetWith(dataPkt, 4, body)); err != nil {
		return 0, err
	}
	return len(b), nil
}

func (t *tunnel) Read(b []byte) (int, error) {
	for len(t.pending) == 0 {
		var raw []byte
		if err := t.stream.RecvMsg(&raw); err != nil {
			if errors.Is(err, io.EOF) {
				return 0, io.EOF
			}
			return 0, err
		}
		p, err := parsePacket(raw)
		if err != nil {
			return 0, err
		}
		switch p.kind {
		case dataPkt:
			t.pending = p.payload
		case closeRsp:
			return 0, io.EOF
		}
	}
	n := copy(b, t.pending)
	t.pending = t.pending[n:]
	return n, nil
}

func (t *tunnel) Close() error {
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(t.connectID))
	t.sendMu.Lock()
	_ = t.stream.SendMsg(packetWith(closeReq, 5, body))
	t.sendMu.Unlock()
	return t.cc.Close()
}
