// An AgentService server on grpc-go, configured as upstream's proxy-server
// configures its agent listener: TLS, a server keepalive, and the keepalive
// enforcement policy (MinTime 30 s, PermitWithoutStream), under which a
// client that pings more often than every 30 s is sent GOAWAY
// ENHANCE_YOUR_CALM ("too_many_pings") and its connection closed.
//
// Each Connect stream gets the response headers upstream's server sends
// (serverid, servercount) and is held until the agent ends it. One line per
// stream opened and ended goes to stdout, so that a test counts them.
//
// usage: agent_server -cert FILE -key FILE -port-file FILE
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"io/ioutil"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
)

// rawCodec passes messages through unread.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(b []byte, v interface{}) error {
	*(v.(*[]byte)) = append([]byte(nil), b...)
	return nil
}
func (rawCodec) String() string { return "proto" }

func fail(step string, err error) {
	fmt.Fprintf(os.Stderr, "%s: %v\n", step, err)
	os.Exit(1)
}

func main() {
	cert := flag.String("cert", "", "server certificate (PEM)")
	key := flag.String("key", "", "its key (PEM)")
	portFile := flag.String("port-file", "", "where to write the port listened on")
	flag.Parse()
	pair, err := tls.LoadX509KeyPair(*cert, *key)
	if err != nil {
		fail("load the certificate", err)
	}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail("listen", err)
	}
	var streams int64
	server := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{pair},
			ClientAuth:   tls.RequestClientCert,
		})),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: time.Hour}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             30 * time.Second,
			PermitWithoutStream: true,
		}),
		grpc.CustomCodec(rawCodec{}),
		grpc.UnknownServiceHandler(func(_ interface{}, stream grpc.ServerStream) error {
			n := atomic.AddInt64(&streams, 1)
			method, _ := grpc.MethodFromServerStream(stream)
			fmt.Printf("stream %d opened: %s\n", n, method)
			if err := stream.SendHeader(metadata.Pairs("serverid", "go-server", "servercount", "1")); err != nil {
				fmt.Printf("stream %d ended: %v\n", n, err)
				return err
			}
			for {
				var message []byte
				if err := stream.RecvMsg(&message); err != nil {
					fmt.Printf("stream %d ended: %v\n", n, err)
					return nil
				}
			}
		}),
	)
	port := strconv.Itoa(listener.Addr().(*net.TCPAddr).Port)
	if err := ioutil.WriteFile(*portFile, []byte(port), 0o644); err != nil {
		fail("write the port file", err)
	}
	if err := server.Serve(listener); err != nil {
		fail("serve", err)
	}
}
