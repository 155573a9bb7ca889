// connect-client: the benchmark's second, independent client for the HTTP
// CONNECT route, written the way Go programs (kube-apiserver among them)
// talk to a konnectivity server: net.Dial on the Unix socket, the CONNECT
// request written with one Fprintf, the answer read with
// http.ReadResponse through a bufio.Reader, then plain Write/io.ReadFull on
// the connection. Standard library only, so it builds without modules.
//
// Each run measures one figure and prints it as one JSON line; konnectivity-bench
// runs it for the direct route (no -proxy-uds) and the tunneled one.
package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"time"
)

var (
	proxyUDS = flag.String("proxy-uds", "", "the server's CONNECT Unix socket; empty dials the target directly")
	target   = flag.String("target", "", "host:port of the benchmark target")
	mode     = flag.String("mode", "", "rtt (echo target), dial (echo target), upload (sink target), download (source target)")
	size     = flag.Int("size", 1024, "message size of rtt and dial")
	count    = flag.Int("count", 5000, "round trips (rtt) or connections (dial)")
	bytes    = flag.Int64("bytes", 1<<30, "bytes moved by upload and download")
)

// writeSize is what a busy client hands the kernel per write in bulk transfers.
const writeSize = 256 * 1024

// dialGRPC opens a connection through the gRPC frontend when the client is
// built with grpc_tunnel.go (`-tags grpc`, Debian's grpc-go) and -grpc-uds
// is set; nil, nil otherwise.
var dialGRPC = func() (net.Conn, error) { return nil, nil }

// open connects to the target, through the tunnel when -proxy-uds (or
// -grpc-uds) is set, and returns the connection and what reads from it:
// the reader holds any bytes that arrived with the CONNECT answer (a target
// that speaks first).
func open() (net.Conn, io.Reader, error) {
	if conn, err := dialGRPC(); conn != nil || err != nil {
		return conn, conn, err
	}
	if *proxyUDS == "" {
		conn, err := net.Dial("tcp", *target)
		return conn, conn, err
	}
	conn, err := net.Dial("unix", *proxyUDS)
	if err != nil {
		return nil, nil, err
	}
	fmt.Fprintf(conn, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", *target, "127.0.0.1")
	reader := bufio.NewReader(conn)
	response, err := http.ReadResponse(reader, nil)
	if err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("reading the CONNECT answer: %v", err)
	}
	if response.StatusCode != http.StatusOK {
		conn.Close()
		return nil, nil, fmt.Errorf("CONNECT %s refused: %s", *target, response.Status)
	}
	return conn, reader, nil
}

// openQuiet is open for targets that only answer: nothing may arrive
// before the client sent something, so it reads the connection directly.
func openQuiet() (net.Conn, error) {
	conn, reader, err := open()
	if err != nil {
		return nil, err
	}
	if buffered, ok := reader.(*bufio.Reader); ok && buffered.Buffered() > 0 {
		conn.Close()
		return nil, fmt.Errorf("%d bytes after the CONNECT answer, before any were sent", buffered.Buffered())
	}
	return conn, nil
}

// roundTrip writes message and reads as many bytes back.
func roundTrip(conn net.Conn, message, answer []byte) error {
	if _, err := conn.Write(message); err != nil {
		return err
	}
	_, err := io.ReadFull(conn, answer)
	return err
}

func percentile(samples []time.Duration, p float64) float64 {
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	index := int(float64(len(samples)-1)*p + 0.5)
	return float64(samples[index].Nanoseconds()) / 1e3
}

// rtt: round trips on one warm connection; the first tenth is not counted.
func rtt() (map[string]float64, error) {
	conn, err := openQuiet()
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	message, answer := make([]byte, *size), make([]byte, *size)
	for i := range message {
		message[i] = byte(i)
	}
	warmUp := *count / 10
	samples := make([]time.Duration, 0, *count)
	for i := 0; i < warmUp+*count; i++ {
		started := time.Now()
		if err := roundTrip(conn, message, answer); err != nil {
			return nil, err
		}
		if i >= warmUp {
			samples = append(samples, time.Since(started))
		}
	}
	for i := range message {
		if message[i] != answer[i] {
			return nil, fmt.Errorf("the echo returned different bytes")
		}
	}
	return map[string]float64{"p50_us": percentile(samples, 0.5), "p99_us": percentile(samples, 0.99)}, nil
}

// dial: connections one at a time, each opened, used for one round trip
// and closed: what a client that dials per request waits for.
func dial() (map[string]float64, error) {
	message, answer := make([]byte, *size), make([]byte, *size)
	samples := make([]time.Duration, 0, *count)
	started := time.Now()
	for i := 0; i < *count; i++ {
		opened := time.Now()
		conn, err := openQuiet()
		if err != nil {
			return nil, err
		}
		err = roundTrip(conn, message, answer)
		conn.Close()
		if err != nil {
			return nil, err
		}
		samples = append(samples, time.Since(opened))
	}
	elapsed := time.Since(started).Seconds()
	return map[string]float64{"per_second": float64(*count) / elapsed, "p50_us": percentile(samples, 0.5)}, nil
}

// upload: an 8-byte length, then that many bytes to the sink, which
// answers with the same 8 bytes once it has read every one.
func upload() (map[string]float64, error) {
	conn, err := openQuiet()
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	chunk := make([]byte, writeSize)
	header := make([]byte, 8)
	binary.BigEndian.PutUint64(header, uint64(*bytes))
	started := time.Now()
	if _, err := conn.Write(header); err != nil {
		return nil, err
	}
	for left := *bytes; left > 0; {
		n := int64(len(chunk))
		if left < n {
			n = left
		}
		if _, err := conn.Write(chunk[:n]); err != nil {
			return nil, err
		}
		left -= n
	}
	ack := make([]byte, 8)
	if _, err := io.ReadFull(conn, ack); err != nil {
		return nil, fmt.Errorf("reading the sink's ack: %v", err)
	}
	if binary.BigEndian.Uint64(ack) != uint64(*bytes) {
		return nil, fmt.Errorf("the sink acknowledged %d bytes, not %d", binary.BigEndian.Uint64(ack), *bytes)
	}
	return map[string]float64{"bytes_per_second": float64(*bytes) / time.Since(started).Seconds()}, nil
}

// download: reads -bytes from the source, which writes without end.
func download() (map[string]float64, error) {
	conn, reader, err := open()
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	buffer := make([]byte, writeSize)
	started := time.Now()
	for left := *bytes; left > 0; {
		want := int64(len(buffer))
		if left < want {
			want = left
		}
		n, err := reader.Read(buffer[:want])
		if err != nil {
			return nil, err
		}
		left -= int64(n)
	}
	return map[string]float64{"bytes_per_second": float64(*bytes) / time.Since(started).Seconds()}, nil
}

// serveNull serves the null gRPC server instead of measuring, when the
// client is built with null_server.go and -serve-null-grpc is set.
var serveNull = func() bool { return false }

func main() {
	flag.Parse()
	if serveNull() {
		return
	}
	measurements := map[string]func() (map[string]float64, error){
		"rtt": rtt, "dial": dial, "upload": upload, "download": download,
	}
	measure, known := measurements[*mode]
	if !known || *target == "" {
		fmt.Fprintf(os.Stderr, "connect-client: -mode must be rtt, dial, upload or download and -target set (got -mode %q -target %q)\n", *mode, *target)
		os.Exit(2)
	}
	figures, err := measure()
	if err != nil {
		fmt.Fprintf(os.Stderr, "connect-client: %s via %q: %v\n", *mode, *proxyUDS, err)
		os.Exit(1)
	}
	line, _ := json.Marshal(figures)
	fmt.Println(string(line))
}
