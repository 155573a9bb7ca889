// A gRPC ProxyService client built on grpc-go, dialing proxy-server's Unix
// socket exactly as kube-apiserver's egress selector does: the socket path
// as the gRPC target with a context dialer (so grpc-go's passthrough
// resolver derives the :authority from the path), WithBlock and
// WithReturnConnectionError, insecure credentials, one connection for the
// whole run and one Proxy stream per dial, several of them at once.
// Packets are encoded with protowire, so no generated code is needed.
//
// Exits non-zero, naming the step, on any deviation from the protocol.
//
// usage: kas_client -socket PATH -echo HOST:PORT -closed HOST:PORT [-authority VALUE]
//
//	kas_client -socket PATH -echo HOST:PORT -lines DURATION
//
// The second form holds one tunnel to the echo target for DURATION, as a
// `kubectl logs -f` through kube-apiserver: a numbered line every 10 ms, each
// read back before the next; any line missing, doubled or out of order, or
// the stream failing, exits non-zero. It prints the lines and the longest
// wait for one.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"math/rand"
	"net"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/encoding/protowire"
)

// Packet types and field numbers of konnectivity's client.proto.
const (
	dialReq  = 0
	dialRsp  = 1
	closeReq = 2
	closeRsp = 3
	data     = 4
)

// packet is the part of a Packet this client reads.
type packet struct {
	kind      uint64
	errorText string
	connectID int64
	random    int64
	payload   []byte
}

// rawCodec passes encoded Packets through grpc-go unchanged.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return v.([]byte), nil }
func (rawCodec) Unmarshal(b []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), b...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func message(kind uint64, field protowire.Number, body []byte) []byte {
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, kind)
	b = protowire.AppendTag(b, field, protowire.BytesType)
	return protowire.AppendBytes(b, body)
}

func dialRequest(address string, random int64) []byte {
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.BytesType)
	body = protowire.AppendString(body, "tcp")
	body = protowire.AppendTag(body, 2, protowire.BytesType)
	body = protowire.AppendString(body, address)
	body = protowire.AppendTag(body, 3, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(random))
	return message(dialReq, 2, body)
}

func dataPacket(connectID int64, payload []byte) []byte {
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(connectID))
	body = protowire.AppendTag(body, 3, protowire.BytesType)
	body = protowire.AppendBytes(body, payload)
	return message(data, 4, body)
}

func closeRequest(connectID int64) []byte {
	var body []byte
	body = protowire.AppendTag(body, 1, protowire.VarintType)
	body = protowire.AppendVarint(body, uint64(connectID))
	return message(closeReq, 5, body)
}

// parse reads a Packet's type and the fields of whichever payload it has
// (every payload message keeps error, connectID, random and data on the
// same small set of field numbers; see client.proto).
func parse(b []byte) (packet, error) {
	var p packet
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return p, protowire.ParseError(n)
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 {
				return p, protowire.ParseError(n)
			}
			p.kind, b = v, b[n:]
		case typ == protowire.BytesType:
			inner, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return p, protowire.ParseError(n)
			}
			b = b[n:]
			if err := p.payloadFields(num, inner); err != nil {
				return p, err
			}
		default:
			n := protowire.ConsumeFieldValue(num, typ, b)
			if n < 0 {
				return p, protowire.ParseError(n)
			}
			b = b[n:]
		}
	}
	return p, nil
}

func (p *packet) payloadFields(payload protowire.Number, b []byte) error {
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
			case payload == 3 && num == 2, payload == 4 && num == 1, payload == 6 && num == 2:
				p.connectID = int64(v)
			case payload == 3 && num == 3:
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
		case num == 1 && (payload == 3 || payload == 6):
			p.errorText = string(v)
		case payload == 4 && num == 3:
			p.payload = v
		}
	}
	return nil
}

type stream struct{ grpc.ClientStream }

func (s stream) send(b []byte) error { return s.SendMsg(b) }
func (s stream) recv() (packet, error) {
	var b []byte
	if err := s.RecvMsg(&b); err != nil {
		return packet{}, err
	}
	return parse(b)
}

func open(ctx context.Context, conn *grpc.ClientConn) (stream, error) {
	s, err := conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true},
		"/ProxyService/Proxy", grpc.ForceCodec(rawCodec{}))
	return stream{s}, err
}

func dial(s stream, address string) (packet, error) {
	random := rand.Int63()
	if err := s.send(dialRequest(address, random)); err != nil {
		return packet{}, fmt.Errorf("send DIAL_REQ: %w", err)
	}
	rsp, err := s.recv()
	if err != nil {
		return rsp, fmt.Errorf("receive DIAL_RSP: %w", err)
	}
	if rsp.kind != dialRsp || rsp.random != random {
		return rsp, fmt.Errorf("DIAL_RSP echoing %d expected, got %+v", random, rsp)
	}
	return rsp, nil
}

// echoRound dials the echo target, sends 4 KiB, reads it back and closes.
func echoRound(ctx context.Context, conn *grpc.ClientConn, echo string, seed int64) error {
	s, err := open(ctx, conn)
	if err != nil {
		return fmt.Errorf("open Proxy stream: %w", err)
	}
	rsp, err := dial(s, echo)
	if err != nil {
		return err
	}
	if rsp.errorText != "" || rsp.connectID <= 0 {
		return fmt.Errorf("dial failed: %+v", rsp)
	}
	payload := make([]byte, 4096)
	rand.New(rand.NewSource(seed)).Read(payload)
	// The echo target speaks the tests' protocol: 'E' and 16 header bytes.
	if err := s.send(dataPacket(rsp.connectID, append(append([]byte{'E'}, make([]byte, 16)...), payload...))); err != nil {
		return fmt.Errorf("send DATA: %w", err)
	}
	var echoed []byte
	for len(echoed) < len(payload) {
		p, err := s.recv()
		if err != nil {
			return fmt.Errorf("receive DATA: %w", err)
		}
		if p.kind != data || p.connectID != rsp.connectID {
			return fmt.Errorf("DATA for %d expected, got %+v", rsp.connectID, p)
		}
		echoed = append(echoed, p.payload...)
	}
	if !bytes.Equal(echoed, payload) {
		return fmt.Errorf("echoed bytes differ from the sent ones")
	}
	if err := s.send(closeRequest(rsp.connectID)); err != nil {
		return fmt.Errorf("send CLOSE_REQ: %w", err)
	}
	p, err := s.recv()
	if err != nil {
		return fmt.Errorf("receive CLOSE_RSP: %w", err)
	}
	if p.kind != closeRsp || p.connectID != rsp.connectID || p.errorText != "" {
		return fmt.Errorf("clean CLOSE_RSP for %d expected, got %+v", rsp.connectID, p)
	}
	return s.CloseSend()
}

// lines holds one tunnel for `hold`, echoing a numbered line every 10 ms.
func lines(conn *grpc.ClientConn, echo string, hold time.Duration) {
	s, err := open(context.Background(), conn)
	if err != nil {
		fail("open Proxy stream: %v", err)
	}
	rsp, err := dial(s, echo)
	if err != nil {
		fail("%v", err)
	}
	if rsp.errorText != "" || rsp.connectID <= 0 {
		fail("dial failed: %+v", rsp)
	}
	id := rsp.connectID
	if err := s.send(dataPacket(id, append([]byte{'E'}, make([]byte, 16)...))); err != nil {
		fail("send the echo header: %v", err)
	}
	var pending []byte
	var longest time.Duration
	sent := 0
	for end := time.Now().Add(hold); time.Now().Before(end); sent++ {
		line := []byte(fmt.Sprintf("line %d\n", sent))
		started := time.Now()
		if err := s.send(dataPacket(id, line)); err != nil {
			fail("line %d: send: %v", sent, err)
		}
		for !bytes.Contains(pending, []byte("\n")) {
			p, err := s.recv()
			if err != nil {
				fail("line %d: the stream failed: %v", sent, err)
			}
			if p.kind != data || p.connectID != id {
				fail("line %d: DATA for %d expected, got %+v", sent, id, p)
			}
			pending = append(pending, p.payload...)
		}
		cut := bytes.IndexByte(pending, '\n') + 1
		if !bytes.Equal(pending[:cut], line) {
			fail("line %d: got %q: a line missing, doubled or out of order", sent, pending[:cut])
		}
		pending = pending[cut:]
		if wait := time.Since(started); wait > longest {
			longest = wait
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := s.send(closeRequest(id)); err != nil {
		fail("send CLOSE_REQ: %v", err)
	}
	fmt.Printf("lines: %d echoed, longest wait %dms\n", sent, longest.Milliseconds())
}

func fail(format string, args ...interface{}) {
	fmt.Printf("FAIL: "+format+"\n", args...)
	os.Exit(1)
}

func main() {
	socket := flag.String("socket", "", "proxy-server's Unix socket")
	echo := flag.String("echo", "", "echo target host:port")
	closed := flag.String("closed", "", "a host:port nothing listens on")
	authority := flag.String("authority", "", "override the :authority (grpc-go's default when empty)")
	concurrent := flag.Int("concurrent", 8, "dials at once on the one connection")
	hold := flag.Duration("lines", 0, "hold one tunnel this long, echoing a line every 10 ms")
	flag.Parse()
	// Dial ids come from the global source, as konnectivity-client's do;
	// Go before 1.20 (Debian's) seeds it with 1, so every process would
	// draw the same ids. kube-apiserver's Go seeds it at random: so do we.
	rand.Seed(time.Now().UnixNano())

	options := []grpc.DialOption{
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", *socket)
		}),
		grpc.WithBlock(),
		grpc.WithReturnConnectionError(),
		grpc.WithInsecure(),
	}
	if *authority != "" {
		options = append(options, grpc.WithAuthority(*authority))
	}
	dialCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(dialCtx, *socket, options...)
	if err != nil {
		fail("connect to %s: %v", *socket, err)
	}
	defer conn.Close()
	fmt.Printf("channel target %q, authority override %q\n", conn.Target(), *authority)
	if *hold > 0 {
		lines(conn, *echo, *hold)
		return
	}

	// 1. Dials one after another, then many at once on the same connection
	// (grpc-go's HPACK encoder refers back to the :authority it indexed).
	for round := 0; round < 3; round++ {
		if err := echoRound(context.Background(), conn, *echo, int64(round)); err != nil {
			fail("round %d: %v", round, err)
		}
	}
	var wg sync.WaitGroup
	errs := make(chan error, *concurrent)
	for i := 0; i < *concurrent; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			// A deadline makes grpc-go send grpc-timeout, as a request
			// context with a timeout does in kube-apiserver.
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := echoRound(ctx, conn, *echo, int64(100+i)); err != nil {
				errs <- fmt.Errorf("concurrent dial %d: %w", i, err)
			}
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		fail("%v", err)
	}
	fmt.Printf("%d sequential and %d concurrent dials echoed 4 KiB each\n", 3, *concurrent)

	// 2. A refused dial carries the agent's error text.
	s, err := open(context.Background(), conn)
	if err != nil {
		fail("open Proxy stream: %v", err)
	}
	rsp, err := dial(s, *closed)
	if err != nil {
		fail("refused dial: %v", err)
	}
	if rsp.connectID != 0 || !bytes.Contains([]byte(rsp.errorText), []byte("connection refused")) {
		fail("refused dial names the error, got %+v", rsp)
	}
	s.CloseSend()
	fmt.Printf("refused dial: %s\n", rsp.errorText)
	fmt.Println("grpc-go client: all protocol checks passed")
}
