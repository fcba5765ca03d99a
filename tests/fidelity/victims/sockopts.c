/* fidelity: socket options a process sets (SO_PRIORITY, SO_BINDTODEVICE, buffers, timeouts,
 * IP_PKTINFO, IP_RECVERR, IP_MTU_DISCOVER, IP_FREEBIND, UDP_GRO, ...) */
#include "../victim.h"
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

static long opt(int fd, int level, int name)
{
	int v = -1;
	socklen_t n = sizeof v;
	return getsockopt(fd, level, name, &v, &n) ? -1000 : v;
}

int main(void)
{
	fid_init();
	int u = socket(AF_INET, SOCK_DGRAM, 0), t = socket(AF_INET, SOCK_STREAM, 0);
	MUST(u);
	MUST(t);
	int prio = 5, tos = IPTOS_LOWDELAY, rcv = 65536, one = 1, idle = 77;
	MUST(setsockopt(u, IPPROTO_IP, IP_TOS, &tos, sizeof tos));  /* sets the priority too: first */
	MUST(setsockopt(u, SOL_SOCKET, SO_PRIORITY, &prio, sizeof prio));
	MUST(setsockopt(u, SOL_SOCKET, SO_BINDTODEVICE, "lo", 3));
	MUST(setsockopt(u, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof rcv));
	struct timeval tv = {3, 250000};
	MUST(setsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv));
	int pmtu = IP_PMTUDISC_DO;
	MUST(setsockopt(u, IPPROTO_IP, IP_PKTINFO, &one, sizeof one));
	MUST(setsockopt(u, IPPROTO_IP, IP_RECVERR, &one, sizeof one));
	MUST(setsockopt(u, IPPROTO_IP, IP_MTU_DISCOVER, &pmtu, sizeof pmtu));
	MUST(setsockopt(u, IPPROTO_IP, IP_FREEBIND, &one, sizeof one));
	MUST(setsockopt(u, IPPROTO_UDP, 104 /* UDP_GRO */, &one, sizeof one));
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK), .sin_port = htons(47011)};
	MUST(bind(u, (void *)&a, sizeof a));
	MUST(setsockopt(t, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one));
	MUST(setsockopt(t, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one));
	MUST(setsockopt(t, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle));
	MUST(setsockopt(t, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one));
	struct linger lg = {1, 9};
	MUST(setsockopt(t, SOL_SOCKET, SO_LINGER, &lg, sizeof lg));
	a.sin_port = htons(47012);
	MUST(bind(t, (void *)&a, sizeof a));
	MUST(listen(t, 8));
	MUST(fcntl(t, F_SETFL, O_NONBLOCK));
	ready();
	wait_term();
	EQ("SO_PRIORITY", opt(u, SOL_SOCKET, SO_PRIORITY), 5);
	char dev[IFNAMSIZ] = {0};
	socklen_t n = sizeof dev;
	getsockopt(u, SOL_SOCKET, SO_BINDTODEVICE, dev, &n);
	STREQ("SO_BINDTODEVICE", dev, "lo");
	EQ("IP_TOS", opt(u, IPPROTO_IP, IP_TOS), IPTOS_LOWDELAY);
	EQ("IP_PKTINFO", opt(u, IPPROTO_IP, IP_PKTINFO), 1);
	EQ("IP_RECVERR", opt(u, IPPROTO_IP, IP_RECVERR), 1);
	EQ("IP_MTU_DISCOVER", opt(u, IPPROTO_IP, IP_MTU_DISCOVER), IP_PMTUDISC_DO);
	EQ("IP_FREEBIND", opt(u, IPPROTO_IP, IP_FREEBIND), 1);
	EQ("UDP_GRO", opt(u, IPPROTO_UDP, 104), 1);
	EQ("SO_RCVBUF (doubled by the kernel)", opt(u, SOL_SOCKET, SO_RCVBUF), 2 * 65536);
	struct timeval got;
	n = sizeof got;
	getsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &got, &n);
	EQ("SO_RCVTIMEO s", got.tv_sec, 3);
	NEAR("SO_RCVTIMEO us (in jiffies)", got.tv_usec, 250000, 10000);
	EQ("SO_KEEPALIVE", opt(t, SOL_SOCKET, SO_KEEPALIVE), 1);
	EQ("TCP_NODELAY", opt(t, IPPROTO_TCP, TCP_NODELAY), 1);
	EQ("TCP_KEEPIDLE", opt(t, IPPROTO_TCP, TCP_KEEPIDLE), 77);
	EQ("SO_REUSEADDR", opt(t, SOL_SOCKET, SO_REUSEADDR), 1);
	EQ("SO_ACCEPTCONN", opt(t, SOL_SOCKET, SO_ACCEPTCONN), 1);
	struct linger gl;
	n = sizeof gl;
	getsockopt(t, SOL_SOCKET, SO_LINGER, &gl, &n);
	EQ("SO_LINGER on", gl.l_onoff, 1);
	EQ("SO_LINGER s", gl.l_linger, 9);
	EQ("O_NONBLOCK", fcntl(t, F_GETFL) & O_NONBLOCK, O_NONBLOCK);
	struct sockaddr_in b;
	n = sizeof b;
	getsockname(u, (void *)&b, &n);
	EQ("UDP port", ntohs(b.sin_port), 47011);
	n = sizeof b;
	getsockname(t, (void *)&b, &n);
	EQ("TCP port", ntohs(b.sin_port), 47012);
	return report();
}
